"""`tessel serve --plan`: the OpenAI API through a 2-stage pipeline (this process is stage 0),
streaming included, tokens equal the single-process engine's; a dead stage gives 503 and /health
names it."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from pipeline_plans import write_plan
from tessel import LLM, SamplingParams

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from tessel.pipeline.options import RunOptions  # noqa: E402
from tessel.pipeline.supervision.supervisor import Supervisor  # noqa: E402
from tessel.server.app import create_app  # noqa: E402

DEADLINE_S = 60.0


def _wait(condition, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # a poll interval


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_serve_through_a_pipeline(tiny_dirs, tmp_path, async_scheduling):
    """With async scheduling stage 0 computes its decode micro-batches on a worker thread: the same
    tokens, and a stage killed while it runs still gives 503, never a hang."""
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 3), (3, 5)], micro_batches=2)
    options = RunOptions(plan, model, async_scheduling=async_scheduling)
    engine = Supervisor.serve(options, max_rebuilds=0)  # a lost stage stays lost
    try:
        app = create_app(engine, max_pending=16)
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
            assert (engine.executor.num_overlapped > 0) == async_scheduling

            os.kill(engine.executor.stages.procs[0].pid, signal.SIGKILL)  # stage 1
            _wait(lambda: client.get("/health").status_code == 503, "/health to report the dead stage")
            health = client.get("/health").text
            assert "stage 1" in health and "SIGKILL" in health
            assert client.post("/v1/completions", json=body).status_code == 503
    finally:
        engine.supervisor.close()


LONG_PROMPT = "Paged attention stores keys and values in blocks; a table maps positions to blocks. " * 12


def test_logprobs_of_cpp_chunks_equal_one_process(tiny_dirs, tmp_path):
    """The last stage sends back the logprobs asked for (issue 27: they were dropped, so the server
    answered 500): a prompt's logprobs when its prefill is cut into CPP chunks (each chunk its own
    micro-batch), and each sampled token's, equal the single-process engine's."""
    from tessel.chunk.latency import PipelineLatency
    from tessel.pipeline.chunk_cutter import ChunkCutter
    from tessel.sim.linear import LinearStage

    model = tiny_dirs["untied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 3), (3, 6)], micro_batches=2)
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=3),
        SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True, logprobs=0),
    ]
    prompts = [LONG_PROMPT, "Once upon a time"]
    engine = Supervisor.serve(RunOptions(plan, model), max_rebuilds=0)
    stage = LinearStage(prefill_base_s=1e-4, prefill_per_token_s=1e-4)  # all per token: cut finely
    engine.executor.cutter = ChunkCutter(PipelineLatency((stage, stage)), min_tokens=16, grid_tokens=16)
    try:
        got = engine.generate(prompts, params, use_progress=False)
        stats = engine.executor.stage.stats
        assert stats.cpp_chunks > stats.cpp_prompts == 1  # the long prompt was cut
    finally:
        engine.supervisor.close()
    expected = LLM(model).generate(prompts, params, use_progress=False)
    for out, want in zip(got, expected, strict=True):
        assert out.token_ids == want.token_ids
        pairs = list(zip(out.logprobs, want.logprobs, strict=True))
        if want.prompt_logprobs is not None:
            assert out.prompt_logprobs[0] is None and want.prompt_logprobs[0] is None
            pairs += list(zip(out.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True))
        assert len(out.logprobs) == 5
        for entry, oracle in pairs:
            assert entry.token_id == oracle.token_id
            assert entry.logprob == pytest.approx(oracle.logprob, abs=1e-5)
            assert [i for i, _ in entry.top] == [i for i, _ in oracle.top]
            assert [lp for _, lp in entry.top] == pytest.approx([lp for _, lp in oracle.top], abs=1e-5)
