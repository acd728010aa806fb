"""One OpenAI endpoint over every replica of a plan: `tessel serve --plan P` when P has several.

A process group runs one pipeline, so each replica runs as its own server (`tessel serve --plan P
--replica K`, `tessel.server.replica_backends`) and this router, a FastAPI app, forwards each
request to one of them: `/v1/completions` and `/v1/chat/completions`, streamed or not, with the
backend's status code, body and `Retry-After` passed through, plus an `x-tessel-replica` header
naming the replica that answered.

Routing: a request costs its prompt tokens (counted with the model's tokenizer) plus n x max_tokens
(a chat request without max_tokens: what the context leaves). A replica's outstanding tokens are
the costs of the requests forwarded to it and not finished. The request goes to the replica with
the least (outstanding + cost) / weight, the weights being the plan's (each replica's share of the
requests; ties go to the larger weight, then the lower index). Under load this splits the tokens
in flight in proportion to the weights; one request at a time always finds every replica idle, so
it goes to the replica of the largest weight.

Failures. A backend that answers 429 (its queue is full) or 503 (its pipeline is being rebuilt
after a stage failure, or is gone), or whose connection breaks before the response started, has
the request re-sent to the next replica in that order; the last one's answer is passed through. A
backend whose process exits, or that answers no `/health` probe for the heartbeat timeout (it is
then killed), is failed for good: it gets no more requests, the others serve on (re-routing), a
stream it was sending ends with an OpenAI error event naming the replica and the cause, and once
every replica is failed each request gets 503 naming each replica and its error. A failed backend
is not restarted. `/health` answers 200 while a replica can serve (`"degraded"`, listing the
failed ones, when not all can), else 503.

`/metrics`: every backend's metrics with a `replica="K"` label added (a pipeline's per-stage
metrics carry `stage` too, `tessel.server.prometheus`), and the router's own, per replica:
`tessel:router_requests_total` (answered by it), `tessel:router_rerouted_total` (sent on from it),
`tessel:router_routed_tokens_total` (the costs above), `tessel:router_outstanding_tokens`,
`tessel:router_requests_in_flight`, `tessel:replica_up` (1 while it takes requests) and
`tessel:replica_weight`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from tessel.pipeline.supervision.launcher import POLL_S
from tessel.server.disconnect import unless_disconnected
from tessel.server.listen import run_server
from tessel.server.protocol import DEFAULT_COMPLETION_MAX_TOKENS
from tessel.server.replica_backends import (
    PROBE_TIMEOUT_S,
    Backend,
    ReplicaSpec,
    SpawnBackend,
    local_backends,
    start_backends,
    stop_backends,
)
from tessel.text import check_text

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
RESEND_STATUSES = (429, 503)  # the backend took no work: the next replica may
BACKEND_CHECK_INTERVAL_S = 0.5  # how often each backend's process and /health are checked
EXIT_SETTLE_S = 2.0  # after a broken connection, how long the backend's process gets to exit (to name why)
SCRAPE_TIMEOUT_S = 5.0
REPLICA_HEADER = "x-tessel-replica"
PASSED_HEADERS = ("content-type", "retry-after")
_CLIENT_CLOSED_REQUEST = 499  # nginx's code for "client went away"; nobody reads this response


# ---- routing ------------------------------------------------------------------------------------


@dataclass(slots=True)
class ReplicaLoad:
    """What the router knows of one replica: its weight, its work in flight, its counters, its state."""

    index: int
    weight: float
    outstanding_tokens: int = 0
    in_flight: int = 0
    answered: int = 0  # requests it answered (any status)
    rerouted: int = 0  # requests sent on from it to another replica
    routed_tokens: int = 0
    failure: str | None = None  # why it serves no more (for good)
    unavailable: str | None = None  # why its /health answers 503 now (it may come back)

    @property
    def routable(self) -> bool:
        return self.failure is None and self.unavailable is None


@dataclass(slots=True)
class Lease:
    """A request's cost held on a replica until `release()` (idempotent)."""

    load: ReplicaLoad
    tokens: int
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.load.outstanding_tokens -= self.tokens
            self.load.in_flight -= 1


def lease(load: ReplicaLoad, tokens: int) -> Lease:
    load.outstanding_tokens += tokens
    load.in_flight += 1
    load.routed_tokens += tokens
    return Lease(load, tokens)


def ranked(loads: Sequence[ReplicaLoad], tokens: int) -> list[ReplicaLoad]:
    """The replicas to try for a request of `tokens`, best first: those taking requests by least
    (outstanding + tokens) / weight (ties: larger weight, then lower index), then those answering 503
    now in the same order (their 503 is passed on if no other can serve). Failed ones are left out."""

    def key(load: ReplicaLoad) -> tuple[bool, float, float, int]:
        share = (load.outstanding_tokens + tokens) / load.weight
        return (not load.routable, share, -load.weight, load.index)

    return sorted((load for load in loads if load.failure is None), key=key)


def request_tokens(body: Any, prompt_tokens: int, max_model_len: int, chat: bool) -> int:
    """A request's cost: prompt tokens + n x max_tokens (the defaults of the server where absent)."""
    fields = body if isinstance(body, dict) else {}
    max_tokens = fields.get("max_completion_tokens") if chat else None
    max_tokens = max_tokens if _is_count(max_tokens) else fields.get("max_tokens")
    if not _is_count(max_tokens):
        max_tokens = max(max_model_len - prompt_tokens, 0) if chat else DEFAULT_COMPLETION_MAX_TOKENS
    n = fields.get("n", 1)
    return prompt_tokens + (n if _is_count(n) else 1) * max_tokens


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def count_prompt_tokens(tokenizer: Any, body: Any, chat: bool) -> int:
    """The prompt's tokens as the backend will count them; 0 for a body it will refuse anyway."""
    if not isinstance(body, dict):
        return 0
    try:
        if chat:
            messages = [
                {"role": m["role"], "content": check_text(_text(m["content"]), "content")}
                for m in body["messages"]
            ]
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
            return len(ids)
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a one-element batch, as the server takes it
        if isinstance(prompt, str):
            return len(tokenizer(check_text(prompt, "prompt"))["input_ids"])
        return len(prompt) if isinstance(prompt, list) else 0
    except Exception:  # the backend answers this request's error (400) itself
        return 0


def _text(content: Any) -> Any:
    """A message's content as the server joins it: text parts concatenated."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content


# ---- the router ---------------------------------------------------------------------------------


@dataclass(slots=True)
class ReplicaRouter:
    """The backends, their loads, and what routing needs (the tokenizer, the liveness timeout)."""

    backends: list[Backend]
    tokenizer: Any
    silent_timeout_s: float
    loads: list[ReplicaLoad] = field(init=False)
    _tokenize: ThreadPoolExecutor = field(init=False)  # one thread: a tokenizer is not shared

    def __post_init__(self) -> None:
        self.loads = [ReplicaLoad(b.index, b.spec.weight) for b in self.backends]
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="tessel-router-tokenize")

    async def cost(self, path: str, body: bytes) -> int:
        try:
            parsed = json.loads(body)
        except ValueError:
            return 0  # the backend answers 400
        chat = path.endswith("/chat/completions")
        loop = asyncio.get_running_loop()
        prompt = await loop.run_in_executor(self._tokenize, count_prompt_tokens, self.tokenizer, parsed, chat)
        max_model_len = min(b.max_model_len for b in self.backends)
        return request_tokens(parsed, prompt, max_model_len, chat)

    def fail(self, index: int, cause: str) -> str:
        load = self.loads[index]
        if load.failure is None:
            load.failure = cause
        return load.failure

    async def explain(self, index: int, error: Exception) -> str:
        """Why replica `index`'s connection broke: its process's exit (waiting up to EXIT_SETTLE_S for
        it, then failing the replica for good), else the connection error."""
        backend = self.backends[index]
        deadline = asyncio.get_running_loop().time() + EXIT_SETTLE_S
        while backend.exit_cause() is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(POLL_S)
        cause = backend.exit_cause()
        if cause is not None:
            return self.fail(index, cause)
        return f"the connection to it broke ({type(error).__name__}: {error})"

    def states(self) -> list[str]:
        """Per replica that cannot take requests now: 'replica K: why'."""
        return [
            f"replica {load.index}: {load.failure or load.unavailable}"
            for load in self.loads
            if not load.routable
        ]

    def close(self) -> None:
        self._tokenize.shutdown(wait=False)


async def watch_backend(router: ReplicaRouter, index: int, client: httpx.AsyncClient) -> None:
    """Until replica `index` fails: check its process and its /health every BACKEND_CHECK_INTERVAL_S. A
    process that exited, or no answer for `router.silent_timeout_s` (it is then killed), fails it."""
    backend, load = router.backends[index], router.loads[index]
    loop = asyncio.get_running_loop()
    answered_at = loop.time()
    while load.failure is None:
        cause = backend.exit_cause()
        if cause is not None:
            router.fail(index, cause)
            return
        try:
            health = await client.get(f"{backend.url}/health", timeout=PROBE_TIMEOUT_S)
        except httpx.TransportError:
            silent_s = loop.time() - answered_at
            if backend.exit_cause() is None and silent_s > router.silent_timeout_s:
                router.fail(
                    index,
                    f"its server (pid {backend.proc.pid}) answered no /health probe for {silent_s:.0f} s "
                    "(stopped, frozen or starved of CPU); it was killed",
                )
                backend.proc.kill()  # frozen: no graceful shutdown to wait for; its stages die with it
                await asyncio.to_thread(backend.proc.wait)
                return
        else:
            answered_at = loop.time()
            load.unavailable = None if health.status_code == 200 else _error_message(health)
        await asyncio.sleep(BACKEND_CHECK_INTERVAL_S)


# ---- the app ------------------------------------------------------------------------------------


def create_router_app(router: ReplicaRouter, limits: Any = None) -> FastAPI:
    """The FastAPI app of the router (`limits`: a `ServerLimits` for body size and read time); its
    shutdown stops the backends."""
    from prometheus_client import CONTENT_TYPE_LATEST

    from tessel.server.http_errors import install_error_handlers
    from tessel.server.limits import BodyReadTimeout, BodySizeLimit, ServerLimits

    limits = limits or ServerLimits()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(connect=PROBE_TIMEOUT_S, read=None, write=None, pool=None)
        client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))
        state["client"] = client
        watchers = [asyncio.ensure_future(watch_backend(router, b.index, client)) for b in router.backends]
        try:
            yield
        finally:
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            await client.aclose()
            # here, not after uvicorn returns: on SIGTERM uvicorn re-raises the signal once the app
            # has shut down, and the process ends there
            await asyncio.to_thread(stop_backends, router.backends)

    app = FastAPI(title="tessel replica router", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_body_bytes=limits.max_body_bytes)
    app.add_middleware(BodyReadTimeout, body_timeout_s=limits.body_timeout_s)
    app.state.router = router
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if not any(load.routable for load in router.loads):
            return no_replica(router, [])
        down = router.states()
        return JSONResponse({"status": "degraded", "replicas_down": down} if down else {"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await render_metrics(router, state["client"]), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        for load in ranked(router.loads, 0):
            try:
                answer = await state["client"].get(f"{router.backends[load.index].url}/v1/models")
            except httpx.TransportError:
                continue
            return _passed_on(answer.content, answer, load.index)
        return no_replica(router, [])

    async def forward(raw: Request, path: str) -> Response:
        body = await raw.body()
        tokens = await router.cost(path, body)
        return await send_to_replicas(router, state["client"], raw, path, body, tokens)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await forward(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await forward(raw, "/v1/chat/completions")

    return app


async def send_to_replicas(
    router: ReplicaRouter, client: httpx.AsyncClient, raw: Request, path: str, body: bytes, tokens: int
) -> Response:
    """Send the request to the replicas in `ranked` order until one takes it; its answer, relayed."""
    causes: list[str] = []
    candidates = ranked(router.loads, tokens)
    headers = {"content-type": raw.headers.get("content-type", "application/json")}
    for position, load in enumerate(candidates):
        if load.failure is not None:  # failed while an earlier one was tried
            causes.append(f"replica {load.index}: {load.failure}")
            continue
        last = position == len(candidates) - 1
        held = lease(load, tokens)
        url = f"{router.backends[load.index].url}{path}"
        try:
            sent = client.send(client.build_request("POST", url, content=body, headers=headers), stream=True)
            left, upstream = await unless_disconnected(raw, sent)
            if left:
                held.release()
                return Response(status_code=_CLIENT_CLOSED_REQUEST)
            if upstream.status_code in RESEND_STATUSES and not last:
                causes.append(f"replica {load.index}: {_error_message(upstream, await upstream.aread())}")
                await upstream.aclose()
                held.release()
                load.rerouted += 1
                continue
            if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                left, content = await unless_disconnected(raw, upstream.aread())
                await upstream.aclose()
                held.release()
                if left:
                    return Response(status_code=_CLIENT_CLOSED_REQUEST)
                load.answered += 1
                return _passed_on(content, upstream, load.index)
        except httpx.TransportError as error:
            held.release()
            load.rerouted += 1
            causes.append(f"replica {load.index}: {await router.explain(load.index, error)}")
            continue
        load.answered += 1
        return StreamingResponse(
            _relay(router, load.index, upstream, held),
            status_code=upstream.status_code,
            headers=_passed_headers(upstream, load.index),
            background=BackgroundTask(_close, upstream, held),
        )
    return no_replica(router, causes)


def no_replica(router: ReplicaRouter, causes: list[str]) -> JSONResponse:
    """503 naming each replica tried and why it did not answer, and each other that cannot serve."""
    from tessel.server.http_errors import error_response

    tried = {cause.split(":", 1)[0] for cause in causes}
    named = "; ".join([*causes, *(state for state in router.states() if state.split(":", 1)[0] not in tried)])
    return error_response(
        503, f"no replica can serve this request: {named}", "engine_error", code="no_replica"
    )


async def _relay(
    router: ReplicaRouter, index: int, upstream: httpx.Response, held: Lease
) -> AsyncIterator[bytes]:
    """The backend's event stream; a broken one ends with an OpenAI error event naming the replica."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.TransportError as error:
        cause = await router.explain(index, error)
        message = f"replica {index} failed during the response: {cause}"
        error_body = {
            "error": {"message": message, "type": "engine_error", "param": None, "code": "replica_failed"}
        }
        yield f"data: {json.dumps(error_body)}\n\ndata: [DONE]\n\n".encode()
    finally:
        held.release()


async def _close(upstream: httpx.Response, held: Lease) -> None:
    held.release()
    await upstream.aclose()


def _passed_headers(upstream: httpx.Response, index: int) -> dict[str, str]:
    headers = {name: upstream.headers[name] for name in PASSED_HEADERS if name in upstream.headers}
    return {**headers, REPLICA_HEADER: str(index)}


def _passed_on(content: bytes, upstream: httpx.Response, index: int) -> Response:
    return Response(content, status_code=upstream.status_code, headers=_passed_headers(upstream, index))


def _error_message(response: httpx.Response, content: bytes | None = None) -> str:
    """The OpenAI error message of a backend's answer, else its status."""
    try:
        return str(json.loads(response.content if content is None else content)["error"]["message"])
    except (ValueError, KeyError, TypeError, httpx.ResponseNotRead):
        return f"HTTP {response.status_code}"


# ---- metrics ------------------------------------------------------------------------------------


async def render_metrics(router: ReplicaRouter, client: httpx.AsyncClient) -> bytes:
    """Every answering backend's metrics with `replica="K"` added, and the router's own."""
    from prometheus_client import CollectorRegistry, generate_latest

    async def scrape(backend: Backend) -> str | None:
        if router.loads[backend.index].failure is not None:
            return None
        try:
            answer = await client.get(f"{backend.url}/metrics", timeout=SCRAPE_TIMEOUT_S)
        except httpx.TransportError:
            return None
        return answer.text if answer.status_code == 200 else None

    texts = await asyncio.gather(*(scrape(backend) for backend in router.backends))
    families = merged_families(
        [
            relabelled(text, backend.index)
            for text, backend in zip(texts, router.backends, strict=True)
            if text
        ]
    )
    registry = CollectorRegistry()
    registry.register(_Families([*families, *router_families(router.loads)]))
    return generate_latest(registry)


class _Families:
    """A prometheus collector of ready-made metric families."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


def relabelled(text: str, replica: int) -> list[Any]:
    """The metric families of a Prometheus text, each sample labelled `replica="K"` too."""
    from prometheus_client.core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families = []
    for family in text_string_to_metric_families(text):
        out = Metric(family.name, family.documentation, family.type, family.unit)
        for sample in family.samples:
            labels = {**sample.labels, "replica": str(replica)}
            out.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
        families.append(out)
    return families


def merged_families(per_replica: list[list[Any]]) -> list[Any]:
    """One family per name (the Prometheus text format's rule), with the samples of every replica."""
    by_name: dict[str, Any] = {}
    for families in per_replica:
        for family in families:
            if family.name in by_name:
                by_name[family.name].samples.extend(family.samples)
            else:
                by_name[family.name] = family
    return list(by_name.values())


# (name, help, counter?, value of a ReplicaLoad) of the router's own metrics, per replica
ROUTER_METRICS = (
    ("router_requests", "Requests the replica answered.", True, lambda r: r.answered),
    ("router_rerouted", "Requests sent on from the replica to another.", True, lambda r: r.rerouted),
    ("router_routed_tokens", "Prompt + max tokens routed to the replica.", True, lambda r: r.routed_tokens),
    ("router_outstanding_tokens", "Tokens routed and not finished.", False, lambda r: r.outstanding_tokens),
    ("router_requests_in_flight", "Requests routed and not finished.", False, lambda r: r.in_flight),
    ("replica_up", "1 while the replica takes requests.", False, lambda r: float(r.routable)),
    ("replica_weight", "The plan's routing weight of the replica.", False, lambda r: r.weight),
)


def router_families(loads: Sequence[ReplicaLoad]) -> list[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    families = []
    for name, text, counter, value in ROUTER_METRICS:
        kind = CounterMetricFamily if counter else GaugeMetricFamily
        family = kind(f"tessel:{name}", text, labels=["replica"])
        for load in loads:
            family.add_metric([str(load.index)], value(load))
        families.append(family)
    return families


# ---- serve --------------------------------------------------------------------------------------


def replica_specs(plan: Path) -> list[ReplicaSpec]:
    """The plan's replicas (index, weight); empty for a plan of one pipeline, and for a flow plan
    (one process group over its placements routes by the flow weights, `tessel.pipeline.flow`)."""
    from tessel.plan.files.plan_file import load_plan

    document = load_plan(plan)
    if document.flow is not None:
        return []
    return [ReplicaSpec(r.index, r.weight) for r in document.replicas]


@dataclass(frozen=True, slots=True)
class RouterOptions:
    model: Path
    plan: Path
    host: str
    port: int
    backend_options: list[str]  # `tessel serve` options every replica's server gets
    heartbeat_timeout_s: float  # a backend silent this long is failed
    limits: Any = None  # ServerLimits: the router's body size and read time
    log_level: str = "info"
    run_dir: Path | None = None  # where replica<K>.log go (default: a new temporary directory)
    executor: str = "local"  # "ray": each replica's server on its first stage's machine
    ray_address: str | None = None
    listener: socket.socket | None = None  # an inherited bound socket to serve on (--listen-fd)


def check_replicas(options: RouterOptions, specs: list[ReplicaSpec]) -> None:
    """Every replica's pipeline against the model and this machine's devices (over Ray: each
    replica's server checks its own machine's), before any process starts."""
    from tessel.pipeline.checks import check_run
    from tessel.pipeline.options import RunOptions

    local = None if options.executor == "local" else []
    for spec in specs:
        check_run(RunOptions(options.plan, options.model, replica=spec.index), local_ranks=local)


def backend_spawner(options: RouterOptions, specs: list[ReplicaSpec]) -> SpawnBackend:
    """How each replica's server starts: a child process here, or (Ray) a process on the machine of
    the replica's first stage, which places the replica's other stages itself."""
    if options.executor == "ray":
        from tessel.pipeline.ray_replicas import ray_backends

        return ray_backends(options.model, options.plan, specs, options.backend_options, options.ray_address)
    return local_backends(options.model, options.plan, options.backend_options)


def serve_replicas(options: RouterOptions, specs: list[ReplicaSpec], echo=print) -> None:
    """Start every replica's server, serve the router until it is stopped, then stop them all."""
    import uvicorn

    from tessel.engine.llm_engine import load_tokenizer

    check_replicas(options, specs)
    tokenizer = load_tokenizer(options.model)
    run_dir = options.run_dir or Path(tempfile.mkdtemp(prefix="tessel-replicas-"))
    echo(f"tessel: starting {len(specs)} replica servers (logs: {run_dir}/replica<K>.log)")
    backends = start_backends(specs, backend_spawner(options, specs), run_dir)
    router = ReplicaRouter(backends, tokenizer, options.heartbeat_timeout_s)
    try:
        app = create_router_app(router, options.limits)
        listed = ", ".join(f"replica {b.index} (weight {b.spec.weight:.3f}) at {b.url}" for b in backends)
        echo(f"tessel: routing over {listed}; serving on http://{options.host}:{options.port}/v1")
        config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level)
        run_server(uvicorn.Server(config), options.listener)
    finally:
        router.close()
        stop_backends(backends)


__all__ = [
    "ReplicaLoad",
    "ReplicaRouter",
    "RouterOptions",
    "create_router_app",
    "ranked",
    "replica_specs",
    "request_tokens",
    "serve_replicas",
]
