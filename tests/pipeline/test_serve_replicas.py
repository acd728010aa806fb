"""`tessel serve --plan P` over a plan of two replicas: one OpenAI endpoint, one server per replica.

The routing function is held to the split its definition implies (equal requests land in
proportion to the weights, exactly; any mix of sizes stays within one request of it). End to end,
`tessel serve` runs as a user starts it (a child process), over the replica plan of
`test_plan_precisions.replica_plan` (rebuilt here; replica 0: two stages, weight 0.625; replica 1: one stage,
0.375): greedy completions and chat equal the single-process `LLM` (held to HF transformers
elsewhere), streamed or not; both replicas serve and the split follows the weights; errors keep
their status codes; `/metrics` labels replica and stage and counts what each backend served; a
backend killed is named (in the stream it broke, in the 503 once none is left) and no request
hangs; and stopping the server leaves no process behind. The router's own paths that need no model
(a silent backend killed; 429 and 503 sent on to the next replica) run over stand-in HTTP servers.

The server suite of tests/server runs over a replica plan too (its `replicas` engine kind), except
its tests that read or hold the engine inside the test process (marked `in_process_engine`: a paused
engine thread, the `AsyncEngine`'s counters), which the router does not have; this module covers the
router's own paths (routing split, failures, disconnects, stopping).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pipeline_plans import REPLICA_WEIGHTS, write_replica_plan
from serve_process import start_serving
from stage_processes import release
from tessel import LLM, SamplingParams

pytest.importorskip("fastapi")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from tessel.pipeline.supervision.launcher import free_port  # noqa: E402
from tessel.server.replica_router import (  # noqa: E402
    ReplicaLoad,
    lease,
    merged_families,
    ranked,
    relabelled,
    request_tokens,
)

START_DEADLINE_S = 300.0  # three processes importing torch on a loaded 2-core machine
DEADLINE_S = 60.0  # any other wait; a healthy answer takes well under a second
MAX_MODEL_LEN = 256
MAX_BODY_BYTES = 100_000
WEIGHTS = REPLICA_WEIGHTS  # replica_plan's
NUM_ROUTED = 40
SPLIT_TOLERANCE = 4  # requests: one that finishes before the last arrives frees room on its replica


# ---- the routing function ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "count", "split"),
    [(WEIGHTS, 40, [25, 15]), ((0.5, 0.3, 0.2), 100, [50, 30, 20]), ((0.7, 0.3), 10, [7, 3])],
)
def test_equal_requests_split_exactly_by_the_weights(weights, count, split):
    loads = [ReplicaLoad(index, weight) for index, weight in enumerate(weights)]
    for _ in range(count):
        lease(ranked(loads, 10)[0], 10)
    assert [load.in_flight for load in loads] == split
    assert [load.outstanding_tokens for load in loads] == [10 * n for n in split]


def test_any_request_sizes_stay_within_one_request_of_the_weights():
    """Each request goes where (outstanding + its tokens) / weight is least, so no replica's
    outstanding / weight exceeds another's by more than the largest request / the smallest weight."""
    rng = random.Random(0)
    weights = (0.5, 0.3, 0.15, 0.05)
    loads = [ReplicaLoad(index, weight) for index, weight in enumerate(weights)]
    held = []
    for _ in range(500):
        tokens = rng.randint(1, 300)
        held.append(lease(ranked(loads, tokens)[0], tokens))
        if rng.random() < 0.3:  # some finish, in any order
            held.pop(rng.randrange(len(held))).release()
        shares = [load.outstanding_tokens / load.weight for load in loads]
        assert max(shares) - min(shares) <= 300 / min(weights) + 1e-9
    for one in held:
        one.release()
        one.release()  # idempotent
    assert all(load.outstanding_tokens == load.in_flight == 0 for load in loads)


def test_failed_replicas_are_left_out_and_unavailable_ones_tried_last():
    loads = [ReplicaLoad(0, 0.5), ReplicaLoad(1, 0.3), ReplicaLoad(2, 0.2)]
    loads[0].failure = "its server process exited"
    loads[1].unavailable = "pipeline stage 1 failed; rebuilding"
    assert [load.index for load in ranked(loads, 5)] == [2, 1]
    lease(loads[2], 1000)
    assert [load.index for load in ranked(loads, 5)] == [2, 1]  # however loaded, 2 can serve now


def test_a_request_costs_its_prompt_and_n_times_its_max_tokens():
    assert request_tokens({"prompt": "x", "max_tokens": 7}, 5, MAX_MODEL_LEN, chat=False) == 12
    assert request_tokens({"prompt": "x"}, 5, MAX_MODEL_LEN, chat=False) == 5 + 16  # OpenAI's default
    assert request_tokens({"prompt": "x", "max_tokens": 7, "n": 3}, 5, MAX_MODEL_LEN, chat=False) == 26
    assert request_tokens({"messages": []}, 5, MAX_MODEL_LEN, chat=True) == MAX_MODEL_LEN  # what is left
    chat = {"messages": [], "max_tokens": 9, "max_completion_tokens": 4}
    assert request_tokens(chat, 5, MAX_MODEL_LEN, chat=True) == 9
    assert request_tokens("not an object", 0, MAX_MODEL_LEN, chat=False) == 16


def test_backend_metrics_get_a_replica_label_and_one_family_each():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    texts = []
    for replica in range(2):
        registry = CollectorRegistry()
        Counter("tessel:prompt_tokens", "Prompt tokens.", registry=registry).inc(10 + replica)
        Gauge("tessel:stage_up", "Up.", ["stage"], registry=registry).labels(stage="1").set(1)
        texts.append(generate_latest(registry).decode())
    families = merged_families([relabelled(text, replica) for replica, text in enumerate(texts)])
    names = [family.name for family in families]
    assert len(names) == len(set(names)) and {"tessel:prompt_tokens", "tessel:stage_up"} <= set(names)
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }
    assert samples[("tessel:prompt_tokens_total", (("replica", "1"),))] == 11
    assert samples[("tessel:stage_up", (("replica", "0"), ("stage", "1")))] == 1


# ---- end to end: `tessel serve --plan` as a child process ------------------------------------


@dataclass
class Router:
    proc: subprocess.Popen
    url: str
    log: Path
    children: set[int]  # every process under the router once it served (backends and their stages)

    def backend_pid(self, replica: int) -> int:
        for pid in self.children:
            argv = _cmdline(pid).split(b"\0")
            if b"tessel.cli" in argv and argv[argv.index(b"--replica") + 1] == str(replica).encode():
                return pid  # a backend: `python -m tessel.cli serve ... --replica K`
        raise AssertionError(f"no backend process of replica {replica} among {self.children}")


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait(condition, what: str, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"timed out after {deadline_s:.0f} s waiting for {what}"
        time.sleep(0.05)  # a poll interval


def _healthy(router: Router) -> bool:
    assert router.proc.poll() is None, f"the server exited: {router.log.read_text()[-3000:]}"
    try:
        return httpx.get(f"{router.url}/health", timeout=5.0).status_code == 200
    except httpx.TransportError:
        return False


def replica_plan(path: Path, model: Path) -> Path:
    return write_replica_plan(path, model)


@pytest.fixture(scope="module")
def replica_model_plan(tiny_dirs, tmp_path_factory) -> tuple[Path, Path]:
    model = tiny_dirs["tied"]
    return model, replica_plan(tmp_path_factory.mktemp("replicas") / "replicas.json", model)


@contextmanager
def _start_router(model: Path, plan: Path, work: Path, *options: str) -> Iterator[Router]:
    log = work / "router.log"
    argv = [
        sys.executable, "-m", "tessel.cli", "serve", "--model", str(model), "--plan", str(plan),
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-gib", "0.01",
        "--max-body-bytes", str(MAX_BODY_BYTES), "--log-level", "warning", *options,
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc, url = start_serving(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    router = Router(proc, url, log, set())
    try:
        _wait(lambda: _healthy(router), "the router and both replicas to start", START_DEADLINE_S)
        router.children = _descendants(proc.pid)
        yield router
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(DEADLINE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        left = router.children | _descendants(proc.pid)  # whatever a failed test left
        release(sorted(pid for pid in left if str(plan).encode() in _cmdline(pid)))  # not a reused pid


@pytest.fixture(scope="module")
def served(replica_model_plan, tmp_path_factory) -> Iterator[Router]:
    model, plan = replica_model_plan
    with _start_router(model, plan, tmp_path_factory.mktemp("router")) as router:
        yield router


@pytest.fixture(scope="module")
def oracle(replica_model_plan):
    llm = LLM(str(replica_model_plan[0]), max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.01)

    def generate(prompts: list, **sampling) -> list:
        return llm.generate(prompts, SamplingParams(**sampling), use_progress=False)

    return generate


def _scrape(url: str) -> dict[str, float]:
    """name{labels} -> value for every sample of /metrics."""
    response = httpx.get(f"{url}/metrics", timeout=DEADLINE_S)
    assert response.status_code == 200, response.text
    samples = {}
    for family in prometheus_parser.text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def _scrape_until(url: str, names: list[str]) -> dict[str, float]:
    """A scrape holding every sample of `names`: the router leaves out a backend that does not
    answer its scrape within SCRAPE_TIMEOUT_S (one busy compiling a CPU graph on a loaded host)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        samples = _scrape(url)
        missing = [name for name in names if name not in samples]
        if not missing or time.monotonic() > deadline:
            assert not missing, f"never scraped: {missing}"
            return samples
        time.sleep(1.0)


def _events(lines) -> list:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


async def _complete_all(url: str, prompts: list[str], max_tokens: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE_S) as client:
        bodies = [
            {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} for p in prompts
        ]
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for body in bodies))


@pytest.mark.slow
def test_both_replicas_serve_token_exact_in_the_weights_split(served, oracle):
    prompts = [f"Request {i}: the quick brown fox number {i * 7}" for i in range(NUM_ROUTED)]
    every_backend = [f'tessel:num_kv_blocks_total{{replica="{replica}"}}' for replica in ("0", "1")]
    before = _scrape_until(served.url, every_backend)
    responses = asyncio.run(_complete_all(served.url, prompts, max_tokens=8))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    expected = oracle(prompts, temperature=0.0, max_tokens=8, ignore_eos=True)
    assert [r.json()["choices"][0]["text"] for r in responses] == [out.text for out in expected]
    split = Counter(r.headers["x-tessel-replica"] for r in responses)
    assert set(split) == {"0", "1"}  # every replica serves
    assert abs(split["0"] - NUM_ROUTED * WEIGHTS[0]) <= SPLIT_TOLERANCE, split
    after = _scrape_until(served.url, every_backend)
    for replica in ("0", "1"):  # the backends counted what the headers say they answered
        label = f'{{finished_reason="length",replica="{replica}"}}'
        served_by_backend = after[f"tessel:request_success_total{label}"] - before.get(
            f"tessel:request_success_total{label}", 0.0
        )
        assert served_by_backend == split[replica]
        routed = f'tessel:router_requests_total{{replica="{replica}"}}'
        assert after[routed] - before[routed] == split[replica]


def test_streamed_and_chat_answers_equal_one_process(served, oracle, replica_model_plan):
    from transformers import AutoTokenizer

    prompt = "Once upon a time there was"
    expected = oracle([prompt], temperature=0.0, max_tokens=12)[0]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
    with httpx.Client(base_url=served.url, timeout=DEADLINE_S) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = list(response.iter_lines())
        assert "data: [DONE]" in lines
        assert "".join(event["choices"][0]["text"] for event in _events(lines)) == expected.text

        messages = [{"role": "user", "content": "What is the capital of France?"}]
        tokenizer = AutoTokenizer.from_pretrained(str(replica_model_plan[0]))
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        want = oracle([list(ids)], temperature=0.0, max_tokens=10)[0].text
        chat = {"messages": messages, "max_tokens": 10, "temperature": 0}
        answer = client.post("/v1/chat/completions", json=chat)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == want
        with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as response:
            deltas = [e["choices"][0]["delta"].get("content") or "" for e in _events(response.iter_lines())]
        assert "".join(deltas) == want
        models = client.get("/v1/models").json()
        assert [card["id"] for card in models["data"]] == [replica_model_plan[0].name]


def test_errors_keep_their_status_codes(served):
    with httpx.Client(base_url=served.url, timeout=DEADLINE_S) as client:
        unknown = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
        assert unknown.status_code == 404 and "gpt-9" in unknown.json()["error"]["message"]
        assert unknown.headers["x-tessel-replica"] in ("0", "1")  # the backend's answer, passed on
        broken = client.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
        too_long = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": MAX_MODEL_LEN + 1})
        assert too_long.status_code == 400 and str(MAX_MODEL_LEN) in too_long.json()["error"]["message"]
        huge = client.post("/v1/completions", json={"prompt": "x" * MAX_BODY_BYTES})
        assert huge.status_code == 413 and "max_body_bytes" in huge.json()["error"]["message"]
        assert client.get("/v1/nothing-here").status_code == 404


def test_metrics_label_replica_and_stage(served):
    stage_up = [
        'tessel:stage_up{device="localhost/cpu0",replica="0",stage="0"}',
        'tessel:stage_up{device="localhost/cpu1",replica="0",stage="1"}',
        'tessel:stage_up{device="localhost/cpu2",replica="1",stage="0"}',
    ]
    samples = _scrape_until(served.url, stage_up)
    assert samples['tessel:stage_up{device="localhost/cpu0",replica="0",stage="0"}'] == 1
    assert samples['tessel:stage_up{device="localhost/cpu1",replica="0",stage="1"}'] == 1
    assert samples['tessel:stage_up{device="localhost/cpu2",replica="1",stage="0"}'] == 1
    assert 'tessel:stage_heartbeat_age_seconds{replica="0",stage="1"}' in samples
    for replica, weight in zip(("0", "1"), WEIGHTS, strict=True):
        assert samples[f'tessel:replica_weight{{replica="{replica}"}}'] == weight
        assert samples[f'tessel:replica_up{{replica="{replica}"}}'] == 1
        assert f'tessel:num_kv_blocks_total{{replica="{replica}"}}' in samples


@pytest.mark.slow
def test_a_client_leaving_a_stream_frees_its_tokens_and_its_backend(served):
    """The backend is held (SIGSTOP) while its stream is open, so the request cannot finish first."""
    body = {"prompt": "Once upon a time", "max_tokens": MAX_MODEL_LEN - 16, "temperature": 0}
    before = _scrape(served.url)
    with httpx.Client(base_url=served.url, timeout=DEADLINE_S) as client:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True, "ignore_eos": True}) as r:
            replica = r.headers["x-tessel-replica"]
            lines = r.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)  # running on its backend
            pid = served.backend_pid(int(replica))
            os.kill(pid, signal.SIGSTOP)
            try:
                held = _scrape(served.url)  # the held backend's own metrics time out: left out
                assert held[f'tessel:router_requests_in_flight{{replica="{replica}"}}'] == 1
                assert held[f'tessel:router_outstanding_tokens{{replica="{replica}"}}'] > body["max_tokens"]
            finally:
                os.kill(pid, signal.SIGCONT)
    aborted = f'tessel:request_success_total{{finished_reason="abort",replica="{replica}"}}'

    def settled() -> bool:
        now = _scrape(served.url)
        names = ("router_outstanding_tokens", "router_requests_in_flight", "num_requests_running")
        idle = all(now[f'tessel:{name}{{replica="{replica}"}}'] == 0 for name in names)
        return idle and now.get(aborted, 0.0) == before.get(aborted, 0.0) + 1

    _wait(settled, "the router and the backend to drop the request")


def test_stopping_the_server_leaves_no_process(served):
    """Runs last in this module: it stops the module's server (SIGTERM, as a supervisor does)."""
    backends = {served.backend_pid(0), served.backend_pid(1)}
    stage = _descendants(served.backend_pid(0))  # replica 0's second stage
    assert len(stage) >= 1 and backends | stage <= served.children
    assert all(_running(pid) for pid in served.children)
    served.proc.send_signal(signal.SIGTERM)
    served.proc.wait(DEADLINE_S)
    # the server stopped them before it exited (dying with it would leave them running a moment more)
    assert not [pid for pid in served.children if _running(pid)]


@pytest.mark.slow
def test_killed_backends_are_named_and_nothing_hangs(replica_model_plan, tmp_path):
    """SIGKILL of the backend a stream runs on: the stream ends with an error event naming it and
    the signal, /health says degraded, the other replica serves on; SIGKILL of that one too: every
    request gets 503 naming both, and the second stage of replica 0 has died with its server."""
    model, plan = replica_model_plan
    with _start_router(model, plan, tmp_path) as router:
        client = httpx.Client(base_url=router.url, timeout=DEADLINE_S)  # no answer in time fails the test
        body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            killed = int(response.headers["x-tessel-replica"])
            lines = response.iter_lines()
            next(lines)
            os.kill(router.backend_pid(killed), signal.SIGKILL)
            error = _events(lines)[-1]["error"]
        assert f"replica {killed} failed" in error["message"] and "SIGKILL" in error["message"]
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert health.json()["replicas_down"][0].startswith(f"replica {killed}:")
        other = 1 - killed
        answer = client.post("/v1/completions", json={**body, "max_tokens": 4})
        assert answer.status_code == 200 and answer.headers["x-tessel-replica"] == str(other)

        os.kill(router.backend_pid(other), signal.SIGKILL)
        refused = client.post("/v1/completions", json={**body, "max_tokens": 4})
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        for replica in (killed, other):
            assert f"replica {replica}: its server process" in message
        assert message.count("SIGKILL") == 2
        assert client.get("/health").status_code == 503
        client.close()
        _wait(lambda: not any(_running(pid) for pid in router.children), "every child process to exit")
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(DEADLINE_S) == -signal.SIGTERM  # uvicorn ends by the signal it caught


@pytest.mark.slow
def test_a_silent_backend_is_killed_and_named(tmp_path):
    """A backend that stops answering /health (SIGSTOP) for the timeout is failed for good, named,
    and killed (a real process answering /health: the watcher's part needs no model)."""
    from tessel.server.replica_backends import Backend, ReplicaSpec
    from tessel.server.replica_router import ReplicaRouter, watch_backend

    port = free_port()
    code = (
        "import http.server as h\n"
        "class H(h.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        f"h.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    backend = Backend(ReplicaSpec(0, 1.0), proc, port, tmp_path / "replica0.log")
    router = ReplicaRouter([backend], tokenizer=None, silent_timeout_s=1.0)
    try:
        _wait(lambda: _answers(backend.url), "the stand-in backend to listen")

        async def watch() -> None:
            async with httpx.AsyncClient() as client:
                task = asyncio.ensure_future(watch_backend(router, 0, client))
                await asyncio.sleep(1.0)
                assert not task.done() and router.loads[0].routable
                os.kill(proc.pid, signal.SIGSTOP)
                await asyncio.wait_for(task, DEADLINE_S)

        asyncio.run(watch())
        assert "answered no /health probe" in router.loads[0].failure
        assert f"pid {proc.pid}" in router.loads[0].failure
        assert proc.poll() == -signal.SIGKILL
    finally:
        router.close()
        if proc.poll() is None:
            release([proc.pid])
            proc.wait()


STAND_IN = """
import http.server, json, sys
status = int(sys.argv[2])
class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def answer(self, code, body, **headers):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self.answer(200, {"status": "ok"})
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        if status == 200:
            self.answer(200, {"choices": [{"text": "from the stand-in"}]})
        else:
            error = {"message": f"stand-in says {status}", "type": "x", "param": None, "code": None}
            self.answer(status, {"error": error}, retry_after="7")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


@pytest.mark.parametrize(
    ("statuses", "answer", "replica"),
    [((503, 200), 200, "1"), ((429, 200), 200, "1"), ((429, 503), 503, "1"), ((200, 503), 200, "0")],
)
def test_a_busy_or_rebuilding_backend_has_the_request_sent_on(tmp_path, statuses, answer, replica):
    """429 (queue full) or 503 (pipeline rebuilding) from the replica tried first: the request goes
    to the next; the last one's answer is passed on with its status and Retry-After. The backends are
    stand-in HTTP servers (the router's part needs no model)."""
    from fastapi.testclient import TestClient

    from tessel.server.replica_backends import Backend, ReplicaSpec
    from tessel.server.replica_router import ReplicaRouter, create_router_app

    backends = []
    for index, (weight, status) in enumerate(zip(WEIGHTS, statuses, strict=True)):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(port), str(status)])
        backends.append(Backend(ReplicaSpec(index, weight), proc, port, tmp_path / f"replica{index}.log"))
    try:
        for backend in backends:
            _wait(lambda backend=backend: _answers(backend.url), "a stand-in backend to listen")
        router = ReplicaRouter(backends, tokenizer=None, silent_timeout_s=DEADLINE_S)
        with TestClient(create_router_app(router)) as client:
            response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            assert response.status_code == answer and response.headers["x-tessel-replica"] == replica
            if answer != 200:
                assert response.json()["error"]["message"] == f"stand-in says {answer}"
                assert response.headers["retry-after"] == "7"
            first_refused = statuses[0] != 200
            assert [load.rerouted for load in router.loads] == [int(first_refused), 0]
            assert [load.answered for load in router.loads] == [int(not first_refused), int(first_refused)]
            assert all(load.outstanding_tokens == load.in_flight == 0 for load in router.loads)
        assert all(backend.proc.poll() is not None for backend in backends)  # the app's shutdown
    finally:
        for backend in backends:
            if backend.proc.poll() is None:
                release([backend.proc.pid])
                backend.proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False
