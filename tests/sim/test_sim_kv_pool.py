"""The simulator's KV pool under memory pressure: evicted KV comes back by the stage's mode (swap or
recompute) at that mode's cost, counted per stage; a plan's evicting stages get their pool."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sim.sim_plans import TINY_LLAMA, plan_stage
from tessel.chunk.latency import PipelineLatency
from tessel.cost.layer import kv_bytes_per_token
from tessel.plan.files.plan_file import load_plan
from tessel.sim.kv_pool import KvPool
from tessel.sim.linear import LinearStage
from tessel.sim.plan_pipeline import pipeline_for
from tessel.sim.requests import Request
from tessel.sim.scheduler import SimSchedulerConfig
from tessel.sim.simulator import SimConfig, batch_compute_time_s, simulate
from tessel.units import GBPS, GIB


def _stage(rng: np.random.Generator) -> LinearStage:
    return LinearStage(
        prefill_base_s=float(rng.uniform(1e-4, 1e-3)),
        prefill_per_token_s=float(rng.uniform(1e-6, 1e-5)),
        attention_s=0.0,
        decode_base_s=float(rng.uniform(1e-4, 1e-3)),
        decode_per_seq_s=float(rng.uniform(0, 1e-5)),
        decode_per_context_s=float(rng.uniform(0, 1e-8)),
        send_latency_s=0.0,
        send_per_token_s=0.0,
    )


def _requests(rng: np.random.Generator, n: int) -> list[Request]:
    arrivals = np.cumsum(rng.exponential(2e-3, size=n))
    return [
        Request(i, float(arrivals[i]), int(rng.integers(5, 60)), int(rng.integers(2, 12))) for i in range(n)
    ]


def _run(pool: KvPool | None, seed: int = 3):
    rng = np.random.default_rng(seed)
    pipeline = PipelineLatency((_stage(rng),))
    config = SimConfig(SimSchedulerConfig(max_num_seqs=8), kv_pools=() if pool is None else (pool,))
    return pipeline, simulate(pipeline, _requests(rng, 30), config)


def test_a_pool_that_holds_everything_changes_nothing():
    _, plain = _run(None)
    _, pooled = _run(KvPool(10**9, "swap", lambda tokens: 1.0))
    assert pooled.intervals == plain.intervals
    assert pooled.kv_restores[0].batches == 0 and pooled.kv_restores[0].tokens == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_an_empty_pool_brings_back_each_batch_its_own_kv_at_the_mode_cost(mode):
    per_token_s = 3e-5
    pipeline, result = _run(KvPool(0, mode, lambda tokens: per_token_s * tokens))
    stats = result.kv_restores[0]
    # nothing stays on the device: each batch restores all the KV its sequences held before it
    own = [sum(item.offset for item in interval.items) for interval in result.intervals]
    assert stats.mode == mode
    assert stats.tokens == sum(own) > 0
    assert stats.batches == sum(1 for tokens in own if tokens > 0)
    assert stats.seconds == pytest.approx(per_token_s * sum(own))
    for interval, tokens in zip(result.intervals, own, strict=True):
        compute = batch_compute_time_s(pipeline.stages[0], _batch(interval))
        assert interval.end_s - interval.start_s == pytest.approx(compute + per_token_s * tokens)


def _batch(interval):
    from tessel.sim.scheduler import MicroBatch

    return MicroBatch(interval.batch_id, interval.items, interval.group)


def test_plan_stages_that_evict_kv_get_a_pool_priced_by_their_mode(tmp_path):
    stages = [plan_stage(0, "A100-80G", 0, 4, False), plan_stage(1, "T4", 4, 8, True)]
    stages[0].update(offload_gib=1.5, kv_preemption="swap", kv_evicted_gib=1.0, host_h2d_gbps=200.0,
                     host_d2h_gbps=100.0)  # fmt: skip
    stages[1].update(offload_gib=0.5, kv_preemption="recompute", kv_evicted_gib=0.5)
    plan = {
        "version": 1,
        "model": {"name": "tiny-llama", "config": TINY_LLAMA},
        "cluster": {"name": "test", "source": "test"},
        "dtype": "fp16",
        "kv_dtype": "fp16",
        "granularity": "layer",
        "stages": stages,
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    plan_file = load_plan(path)
    priced = pipeline_for(plan_file)
    swap, recompute = priced.kv_pools
    token_bytes = kv_bytes_per_token(plan_file.model_spec, "fp16") * 4
    assert (swap.mode, recompute.mode) == ("swap", "recompute")
    assert swap.tokens == int((2.0 - 1.0) * GIB // token_bytes)
    assert recompute.tokens == int((2.0 - 0.5) * GIB // token_bytes)
    assert swap.restore_s(1000) == pytest.approx(1000 * token_bytes * (1 / (200 * GBPS) + 1 / (100 * GBPS)))
    assert recompute.restore_s(1000) == pytest.approx(priced.pipeline.stages[1].prefill_time_s(1000, 0))
    # only the weights part of offload_gib streams in every batch (0.5 GiB over the plan's 200 Gbit/s)
    assert priced.offload_s == pytest.approx((0.5 * GIB / (200 * GBPS), 0.0))
