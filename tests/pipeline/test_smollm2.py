"""The real SmolLM2-135M-Instruct through a 3-stage uneven pipeline: tokens equal the single-process
engine's, and each stage's memory follows its share of the layers."""

from __future__ import annotations

import pytest

from pipeline_plans import write_plan
from tessel import LLM, SamplingParams
from tessel.pipeline.run import RunOptions, run_pipeline

pytestmark = pytest.mark.slow  # four processes load SmolLM2 (3 stages + the reference): ~1-2 min

SPLITS = [(0, 4), (4, 26), (26, 30)]
KV_GIB = 0.05  # small, so the weights dominate what differs between stages


def test_smollm2_three_stages(smollm2_dir, tmp_path):
    plan = write_plan(tmp_path / "plan.json", smollm2_dir, SPLITS, micro_batches=2)
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    run = run_pipeline(
        RunOptions(plan, smollm2_dir, prompts=prompts, max_tokens=12, kv_cache_gib=KV_GIB, max_model_len=512)
    )
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = LLM(smollm2_dir, kv_cache_gib=KV_GIB, max_model_len=512).generate(
        prompts, params, use_progress=False
    )
    assert [r["token_ids"] for r in run.requests] == [out.token_ids for out in expected]

    weights = [s["weight_bytes"] for s in run.stages]
    rss = [s["load_rss_bytes"] for s in run.stages]  # what loading the stage added
    # 22 decoder layers on stage 1 against 4 layers + the 49152 x 576 embedding on stage 0
    assert weights[1] > weights[0] > weights[1] / 3
    print("weights", weights, "load rss", rss)
    for stage in range(3):  # a stage's memory is its weights (+ small KV), not the whole model's
        assert 0.8 * weights[stage] < rss[stage] < 1.5 * weights[stage] + 64 * 2**20
