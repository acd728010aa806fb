"""An engine that fails mid-generation: the server answers 503 in OpenAI's shape, never hangs.

The engine is the real `LLMEngine` with one switch: `step()` raises once `broken` is set, the way
an out-of-memory or a kernel error would surface.
"""

from __future__ import annotations

import json
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

        def step(self) -> list:
            if self.broken:
                raise RuntimeError("simulated device failure")
            return super().step()

    return BreakableEngine(str(tiny_model), max_num_seqs=2, max_model_len=256, kv_cache_gib=0.01)


def test_engine_failure_is_503_and_health_reports_it(broken_engine: Any, serve_in_thread: Any) -> None:
    from tessel.server.app import create_app

    app = create_app(broken_engine, max_pending=4)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        ok = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert ok.status_code == 200, ok.text
        broken_engine.broken = True

        failed = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert failed.status_code == 503
        error = failed.json()["error"]
        assert error["code"] == "engine_dead" and "simulated device failure" in error["message"]

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
