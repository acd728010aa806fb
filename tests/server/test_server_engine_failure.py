"""An engine that fails mid-generation: the server answers 503 in OpenAI's shape, never hangs.

The engine is the real `LLMEngine` with one switch: `step()` raises while `broken` is set (or
once, with `break_once`), the way an out-of-memory or a kernel error would surface. Such a failure
is not pinned on one request: the requests in flight get 503, the loop restarts and serves the
next request, up to `max_engine_restarts`; after that the engine is dead and `on_dead` fires.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

TIMEOUT_S = 60.0  # per HTTP request


@pytest.fixture
def broken_engine(tiny_model: Path) -> Any:
    from tessel.engine.llm_engine import LLMEngine

    class BreakableEngine(LLMEngine):
        broken = False
        break_once = False

        def step(self) -> list:
            if self.broken or self.break_once:
                self.break_once = False
                raise RuntimeError("simulated device failure")
            return super().step()

    return BreakableEngine(str(tiny_model), max_num_seqs=2, max_model_len=256, kv_cache_gib=0.01)


def test_engine_failure_is_503_then_the_loop_restarts(broken_engine: Any, serve_in_thread: Any) -> None:
    from tessel.server.app import create_app

    app = create_app(broken_engine, max_pending=4)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        broken_engine.break_once = True
        failed = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert failed.status_code == 503
        error = failed.json()["error"]
        assert error["code"] == "engine_dead" and "simulated device failure" in error["message"]
        assert "restarted" in error["message"]
        assert client.get("/health").json() == {"status": "ok"}
        ok = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert ok.status_code == 200, ok.text
    assert broken_engine.num_free_blocks == broken_engine.num_total_blocks


def test_engine_failing_past_its_restarts_is_dead(broken_engine: Any, serve_in_thread: Any) -> None:
    from tessel.server.app import create_app
    from tessel.server.limits import ServerLimits

    app = create_app(broken_engine, max_pending=4, limits=ServerLimits(max_engine_restarts=1))
    dead_calls, dead = [], threading.Event()
    # on_dead runs on the engine thread after the 503s are handed over: wait for it, not race it
    app.state.async_engine.on_dead = lambda: (dead_calls.append(True), dead.set())
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        ok = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert ok.status_code == 200, ok.text
        broken_engine.broken = True
        for _ in range(2):  # the first failure restarts, the second is past the limit
            failed = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
            assert failed.status_code == 503
            error = failed.json()["error"]
            assert error["code"] == "engine_dead" and "simulated device failure" in error["message"]
        assert dead.wait(TIMEOUT_S)
        assert dead_calls == [True]

        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        later = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"


def test_engine_failure_mid_stream_ends_the_stream_with_an_error_event(
    broken_engine: Any, serve_in_thread: Any, engine_paused: Any
) -> None:
    from tessel.server.app import create_app

    app = create_app(broken_engine, max_pending=4)
    body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = (line for line in response.iter_lines() if line)
            assert json.loads(next(lines).removeprefix("data: "))["object"] == "text_completion"
            with engine_paused(app.state.async_engine):
                assert broken_engine.has_unfinished_requests()  # so it breaks mid-stream
                broken_engine.broken = True
            rest = list(lines)  # ends: the server does not hang on a dead engine
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == "engine_dead" and "simulated device failure" in error["message"]


class _LostPart(RuntimeError):
    """A failure a restart of the loop cannot mend (as a dead pipeline stage's `StageFailedError`)."""

    recovery = "rebuild"


def test_failure_a_restart_cannot_fix_keeps_the_server_up(broken_engine: Any, serve_in_thread: Any) -> None:
    """It spends no restart and does not call `on_dead` (`tessel serve` would exit: connection
    refused); the server answers: /health and every request 503 with the cause, /v1/models 200."""
    from tessel.server.app import create_app
    from tessel.server.limits import ServerLimits

    app = create_app(broken_engine, max_pending=4, limits=ServerLimits(max_engine_restarts=3))
    async_engine = app.state.async_engine
    dead_calls: list[bool] = []
    async_engine.on_dead = lambda: dead_calls.append(True)

    def step() -> list:
        raise _LostPart("pipeline stage 1 is gone")

    broken_engine.step = step
    body = {"prompt": "hello", "max_tokens": 3}
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        failed = client.post("/v1/completions", json=body)
        assert failed.status_code == 503
        assert "pipeline stage 1 is gone" in failed.json()["error"]["message"]
        assert "retry" not in failed.json()["error"]["message"]  # retrying cannot help
        for _ in range(5):
            health = client.get("/health")
            assert health.status_code == 503 and "pipeline stage 1 is gone" in health.text
            later = client.post("/v1/completions", json=body)
            assert later.status_code == 503 and "pipeline stage 1 is gone" in later.text
        assert client.get("/v1/models").status_code == 200
    assert async_engine.num_restarts == 0 and dead_calls == []


class _StageGone(RuntimeError):
    """A failure only a new pipeline mends (as a dead pipeline stage's `StageFailedError`)."""

    recovery = "rebuild"


def _supervise(engine: Any, model: Path, replacement: Any) -> Any:
    """A pipeline's supervisor behind `engine` (`tessel.pipeline.supervision.supervisor`), whose new
    executors come from `replacement(options)`; the engine's executor then loses a stage."""
    from tessel.pipeline.options import RunOptions
    from tessel.pipeline.supervision.supervisor import Supervisor

    supervisor = Supervisor(RunOptions(model / "plan.json", model), max_rebuilds=3)
    supervisor.attach(engine)
    supervisor._survivors_options = lambda old, error: supervisor.options
    supervisor._replacement = replacement

    def launch(micro_batch: Any, kv_copies: Any) -> None:
        raise _StageGone("pipeline stage 1 is gone")

    engine.executor.launch = launch
    return supervisor


def test_failure_that_needs_a_rebuild_gets_a_new_executor(
    broken_engine: Any, serve_in_thread: Any, tiny_model: Path
) -> None:
    """The supervisor replaces the executor that lost a stage; the request in flight moves into the
    new one and completes as an undisturbed run would; the rebuild counts against the budget."""
    from tessel.engine.executor import LocalExecutor
    from tessel.server.app import create_app

    fresh = LocalExecutor()
    asked: list[Any] = []
    broken = broken_engine.executor
    supervisor = _supervise(broken_engine, tiny_model, lambda options: (asked.append(options), fresh)[1])
    app = create_app(broken_engine, max_pending=4)
    body = {"prompt": "hello", "max_tokens": 3, "temperature": 0}
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        moved = client.post("/v1/completions", json=body)
        assert moved.status_code == 200, moved.text
        again = client.post("/v1/completions", json=body)
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == moved.json()["choices"][0]["text"]
        assert client.get("/health").json() == {"status": "ok"}
    assert asked == [supervisor.options] and broken_engine.executor is fresh is not broken
    assert supervisor.num_rebuilds == 1 and supervisor.last_recovery.moved == 1


def test_rebuild_that_fails_leaves_the_server_up(
    broken_engine: Any, serve_in_thread: Any, tiny_model: Path
) -> None:
    """A rebuild that raises (a stage that dies again while loading): 503 for good with that reason,
    no `on_dead` (the server would exit: connection refused)."""
    from tessel.server.app import create_app

    def replacement(options: Any) -> Any:
        raise _StageGone("pipeline stage 1 failed while loading")

    supervisor = _supervise(broken_engine, tiny_model, replacement)
    app = create_app(broken_engine, max_pending=4)
    async_engine = app.state.async_engine
    dead_calls: list[bool] = []
    async_engine.on_dead = lambda: dead_calls.append(True)
    body = {"prompt": "hello", "max_tokens": 3}
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        assert client.post("/v1/completions", json=body).status_code == 503
        for _ in range(3):
            health = client.get("/health")
            assert health.status_code == 503 and "failed while loading" in health.text
            assert "Retry-After" not in health.headers
            assert client.post("/v1/completions", json=body).status_code == 503
        assert client.get("/v1/models").status_code == 200
    assert dead_calls == [] and supervisor.num_rebuilds == 1
