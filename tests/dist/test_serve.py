"""`tessel serve --plan`: the OpenAI API through a 2-stage pipeline (this process is stage 0),
streaming included, tokens equal the single-process engine's; a dead stage gives 503 and /health
names it."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from dist_plans import write_plan
from tessel import LLM, SamplingParams

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from tessel.dist.serving import pipeline_server_engine  # noqa: E402
from tessel.server.app import create_app  # noqa: E402

DEADLINE_S = 60.0


def _wait(condition, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # a poll interval


def test_serve_through_a_pipeline(tiny_dirs, tmp_path):
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 3), (3, 5)], micro_batches=2)
    engine = pipeline_server_engine(model, plan)
    try:
        app = create_app(engine, max_pending=16)
        engine.watch_stages(app.state.async_engine)
        prompt = "Once upon a time"
        expected = LLM(model).generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        )
        with TestClient(app) as client:
            body = {"model": app.state.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            body["ignore_eos"] = True
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected[0].text

            pieces = []
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        pieces.append(json.loads(line[6:])["choices"][0]["text"])
            assert "".join(pieces) == expected[0].text
            assert client.get("/health").status_code == 200

            os.kill(engine.stages.procs[0].pid, signal.SIGKILL)  # stage 1
            _wait(lambda: client.get("/health").status_code == 503, "/health to report the dead stage")
            health = client.get("/health").text
            assert "stage 1" in health and "SIGKILL" in health
            assert client.post("/v1/completions", json=body).status_code == 503
    finally:
        engine.close()
