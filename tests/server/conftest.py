"""Fixtures for the server tests: a tiny checkpoint, bounded polling, a uvicorn server in a thread,
and the server under test in each of the three kinds `tessel serve` runs.

Servers bind to 127.0.0.1 on a port the OS picks, and every wait polls a condition under a
bounded deadline (no sleeps for synchronisation). The helpers are handed out as fixtures because
the suite imports test modules with `--import-mode=importlib` (no test directory on sys.path).

A module whose `engine` fixture is built with `make_engine` and served with `serve_engine` runs once
per engine kind:
- `single`: one process's `LLMEngine` (`tessel serve`), its app in this process;
- `pipeline`: `tessel serve --plan` of a 2-stage CPU plan of the same checkpoint (this process stage
  0, stage 1 a child process over gloo, two micro-batches in flight), its app in this process;
- `replicas`: `tessel serve --plan` of a plan of two replicas of the same checkpoint (replica 0 the
  2-stage pipeline above, replica 1 a 1-stage one), run as a user starts it: a child process, the
  router (`tessel.server.replica_router`) in front of one server process per replica. The
  `engine` is then the description the router is started from, with the model's tokenizer; the
  router starts once per module (in `serve_engine`, which knows the module's `max_pending`).
The same tests, with the same oracles, hold for all three (test_server_batching runs the first two
only, for the suite's time: a router's start-up is most of a module's time). "The server is idle"
(`Served.wait_idle`) is read from the engine and the app in process, and from the router's
`/metrics` for `replicas` (its requests in flight, and each replica's running and waiting requests
and KV blocks in use).

Two markers leave runs out:
- `single_engine` (request validation, which never reaches the engine): not run on `pipeline`,
  whose server is the same code as `single`'s. It does run on `replicas`, where the errors come
  through the router (its own 404, its JSON and body checks, the backend's 400 passed on).
- `in_process_engine`: not run on `replicas`. These tests hold the engine thread still
  (`engine_paused`: a full server's 429, a client leaving mid-stream or mid-request while its request
  is provably still running) or read the `AsyncEngine`'s counters and hooks (aborted requests, the
  prefix-cache hits of each choice, the scheduler's queues while parked), which live inside another
  process behind the router. The router's own disconnect, abort and re-send paths are covered in
  tests/pipeline/test_serve_replicas.py.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipeline_plans import REPLICA_WEIGHTS  # replica 0 (2 stages), replica 1 (1 stage)
from serve_process import start_serving

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")

DEADLINE_S = 60.0  # upper bound on any wait; the tests normally pass their polls in milliseconds
ROUTER_START_DEADLINE_S = 300.0  # the router and three model processes importing torch on 2 busy cores
POLL_S = 0.01


def wait_until(condition: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
    """Poll `condition` until it holds; fail naming `what` after `deadline_s`."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)  # a poll interval, not a synchronisation sleep


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Run `app` under uvicorn on 127.0.0.1 (free port) in a thread; yield its base URL."""
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
        assert server.started, "uvicorn did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=DEADLINE_S)
        assert not thread.is_alive(), "uvicorn did not stop"


@contextmanager
def engine_paused(async_engine: Any) -> Iterator[None]:
    """Hold the engine thread inside a command while the block runs: no step, add or abort happens.

    Makes "the request is still running when the client leaves" and "the server is full"
    deterministic instead of a race against the generation speed.
    """
    started, release = threading.Event(), threading.Event()
    future = async_engine.submit(lambda: (started.set(), release.wait(DEADLINE_S)))
    try:
        assert started.wait(DEADLINE_S), "the engine thread did not pick up the pause"
        yield
    finally:
        release.set()
        future.result(timeout=DEADLINE_S)


ENGINE_KINDS = ("single", "pipeline", "replicas")
PIPELINE_SLOTS = 2  # the plan's micro-batches in flight (one scheduler each)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "single_engine: not run on the pipeline engine kind (see conftest)")
    config.addinivalue_line(
        "markers", "in_process_engine: needs the engine in the test process; not run on the replicas kind"
    )


def _left_out(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    kind = None if callspec is None else callspec.params.get("engine_kind")
    if kind == "pipeline":
        return item.get_closest_marker("single_engine") is not None
    if kind == "replicas":
        return item.get_closest_marker("in_process_engine") is not None
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the pipeline runs of tests marked `single_engine` and the replicas runs of tests
    marked `in_process_engine`."""
    dropped = [item for item in items if _left_out(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not _left_out(item)]


@dataclass(frozen=True)
class ReplicaPlanEngine:
    """The `replicas` kind's `engine`: what `serve_engine` starts the router from (`tessel serve`
    options per replica server), and the model's tokenizer, the one each replica's engine loads."""

    model: Path
    plan: Path
    work_dir: Path
    serve_options: tuple[str, ...]
    tokenizer: Any


def write_replica_plan(path: Path, model: Path) -> Path:
    """Two replicas of `model` (`pipeline_plans.write_replica_plan`): replica 0 the `pipeline` kind's
    2-stage split with its micro-batches in flight, replica 1 one stage, one micro-batch."""
    from pipeline_plans import write_replica_plan as write

    return write(path, model, micro_batches=PIPELINE_SLOTS)


@contextmanager
def build_engine(
    kind: str, model: Path, work_dir: Path, *, max_num_seqs: int, **options: Any
) -> Iterator[Any]:
    """The engine a server drives. `max_num_seqs` bounds the sequences running at once: a pipeline's
    `PIPELINE_SLOTS` schedulers get an equal share each (so does each scheduler of a replica)."""
    if kind == "single":
        from tessel.engine.llm_engine import LLMEngine

        yield LLMEngine(str(model), max_num_seqs=max_num_seqs, **options)
        return
    if kind == "replicas":
        from tessel.engine.llm_engine import load_tokenizer

        assert max_num_seqs % PIPELINE_SLOTS == 0, max_num_seqs
        plan = write_replica_plan(work_dir / "replicas.json", model)
        named = {"max_num_seqs": max_num_seqs // PIPELINE_SLOTS, **options}
        argv = [f"--{name.replace('_', '-')}={value}" for name, value in named.items()]
        yield ReplicaPlanEngine(model, plan, work_dir, tuple(argv), load_tokenizer(model))
        return
    from pipeline_plans import write_plan
    from tessel.pipeline.options import RunOptions
    from tessel.pipeline.supervision.supervisor import Supervisor

    assert kind == "pipeline" and max_num_seqs % PIPELINE_SLOTS == 0, (kind, max_num_seqs)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    split = [(0, layers // 2), (layers // 2, layers)]
    plan = write_plan(work_dir / "plan.json", model, split, micro_batches=PIPELINE_SLOTS)
    run = RunOptions(plan, model, max_num_seqs=max_num_seqs // PIPELINE_SLOTS, **options)
    engine = Supervisor.serve(run, max_rebuilds=0)
    try:
        yield engine
    finally:
        engine.supervisor.close()


@dataclass(frozen=True)
class Served:
    """A running server under test: its base URL, its app (in-process kinds; None for `replicas`,
    whose router is a child process) and `wait_idle()`: wait until it holds no request, then check
    every KV block is back in its pool."""

    url: str
    app: Any
    wait_idle: Callable[[], None]


@contextmanager
def serve_engine(engine: Any, *, max_pending: int) -> Iterator[Served]:
    """Serve `engine` (from `make_engine`) holding at most `max_pending` unfinished requests: its app
    under uvicorn in a thread, or for `replicas` the router (each replica server `max_pending` too)."""
    if isinstance(engine, ReplicaPlanEngine):
        with serve_router(engine, max_pending=max_pending) as served:
            yield served
        return
    from tessel.server.app import create_app

    app = create_app(engine, max_pending=max_pending)

    def wait_idle() -> None:
        wait_until(lambda: app.state.async_engine.num_pending == 0, "the server to release its requests")
        wait_until(lambda: not engine.has_unfinished_requests(), "the engine to finish its requests")
        assert engine.num_free_blocks == engine.num_total_blocks

    with serve_in_thread(app) as url:
        yield Served(url, app, wait_idle)


def per_replica(url: str) -> dict[str, dict[str, float]]:
    """name -> {replica: value} of the router's /metrics samples labelled by replica alone."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{url}/metrics", timeout=DEADLINE_S)
    assert response.status_code == 200, response.text
    values: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if set(sample.labels) == {"replica"}:
                values.setdefault(sample.name, {})[sample.labels["replica"]] = sample.value
    return values


def _router_idle(url: str) -> None:
    replicas = {str(index) for index in range(len(REPLICA_WEIGHTS))}

    def total(name: str, values: dict[str, dict[str, float]]) -> float:
        assert set(values.get(name, {})) == replicas, f"{name} of every replica in /metrics: {values}"
        return sum(values[name].values())

    wait_until(
        lambda: total("tessel:router_requests_in_flight", per_replica(url)) == 0,
        "the router to release its requests",
    )

    def engines_idle() -> bool:
        values = per_replica(url)
        queued = total("tessel:num_requests_running", values) + total("tessel:num_requests_waiting", values)
        return queued == 0

    wait_until(engines_idle, "the replicas' engines to finish their requests")
    assert total("tessel:num_kv_blocks_used", per_replica(url)) == 0


@contextmanager
def serve_router(engine: ReplicaPlanEngine, *, max_pending: int) -> Iterator[Served]:
    """`tessel serve --plan` over the replica plan, a child process in its own session; stopped with
    SIGTERM (it stops its replica servers, which stop their stages), its session killed if it hangs."""
    import httpx

    # each replica server holds its running sequences + max_queue: at least max_pending
    argv = [
        sys.executable, "-m", "tessel.cli", "serve", "--model", str(engine.model), "--plan", str(engine.plan),
        f"--max-queue={max_pending}", "--log-level=warning", *engine.serve_options,
    ]  # fmt: skip
    log = engine.work_dir / f"router-{time.monotonic_ns()}.log"
    with open(log, "wb") as out:
        proc, url = start_serving(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy() -> bool:
        assert proc.poll() is None, f"the router exited ({proc.returncode}): {log.read_text()[-3000:]}"
        try:
            return httpx.get(f"{url}/health", timeout=5.0).json() == {"status": "ok"}
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, "the router and both replica servers to start", ROUTER_START_DEADLINE_S)
        yield Served(url, None, functools.partial(_router_idle, url))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(DEADLINE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the router's session: its replica servers and stages
                proc.wait()


# the replicas kind starts two pipelines per module: the slow pass of CI runs it
@pytest.fixture(scope="module", params=[*ENGINE_KINDS[:2], pytest.param("replicas", marks=pytest.mark.slow)])
def engine_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def make_engine(
    engine_kind: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., AbstractContextManager[Any]]:
    """`with make_engine(max_num_seqs=..., **engine options) as engine`: this module's engine kind."""
    return functools.partial(build_engine, engine_kind, tiny_model, tmp_path_factory.mktemp(engine_kind))


@pytest.fixture(name="serve_engine", scope="session")
def _serve_engine_fixture() -> Callable[..., AbstractContextManager[Served]]:
    return serve_engine


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("server") / "tiny-llama", arch="llama")


@pytest.fixture(name="wait_until", scope="session")
def _wait_until_fixture() -> Callable[..., None]:
    return wait_until


@pytest.fixture(name="serve_in_thread", scope="session")
def _serve_in_thread_fixture() -> Callable[[Any], Any]:
    return serve_in_thread


@pytest.fixture(name="engine_paused", scope="session")
def _engine_paused_fixture() -> Callable[[Any], Any]:
    return engine_paused
