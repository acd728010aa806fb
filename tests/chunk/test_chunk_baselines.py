"""Baselines: each one's own rule holds, and the planner is never worse than any of them."""

from __future__ import annotations

import numpy as np
import pytest
from chunk_pipelines import mixed_pipeline, uniform_pipeline

from tessel.chunk.baselines import baseline_plans, equal_flop_chunks, fixed_chunks, sglang_chunks
from tessel.chunk.planner import ChunkProblem, plan_chunks


def test_fixed_chunks() -> None:
    assert fixed_chunks(1000, 512) == [512, 488]
    assert fixed_chunks(1024, 512) == [512, 512]
    assert fixed_chunks(100, 512) == [100]


def test_equal_flop_chunks_have_equal_flops() -> None:
    linear = 3000.0
    chunks = equal_flop_chunks(65536, 8, linear, align=1)
    assert sum(chunks) == 65536 and len(chunks) == 8
    ends = np.cumsum(chunks)
    starts = ends - np.asarray(chunks)
    flops = linear * np.asarray(chunks) + np.asarray(chunks) * (starts + np.asarray(chunks) / 2)
    np.testing.assert_allclose(flops, flops.mean(), rtol=1e-3)
    assert chunks[0] > chunks[-1]  # later tokens attend to more keys: later chunks are shorter


def test_sglang_rule_keeps_chunk_runtime_constant() -> None:
    """With smoothing 1 the quadratic root makes every chunk's modelled runtime the first one's;
    with SGLang's 0.75 chunks shrink less; never below base/4, always aligned."""
    quad, lin, base = 1e-9, 1e-5, 4096
    chunks = sglang_chunks(131072, base, quad, lin, 64, None)
    assert sum(chunks) == 131072 and chunks[0] == base
    assert all(c % 64 == 0 for c in chunks[:-1]) and min(chunks[:-1]) >= base // 4
    assert chunks[:-1] == sorted(chunks[:-1], reverse=True)


@pytest.mark.parametrize("uniform", [True, False])
def test_planner_beats_or_ties_every_baseline(uniform: bool) -> None:
    rng = np.random.default_rng(17 + uniform)
    for _ in range(3):
        n_stages = int(rng.integers(2, 6))
        pipeline = uniform_pipeline(rng, n_stages) if uniform else mixed_pipeline(rng, n_stages)
        problem = ChunkProblem(pipeline, (int(rng.integers(2000, 6000)),), 64, flops_linear_tokens=500.0)
        baselines = baseline_plans(problem)
        assert {"none", "fixed-512", "fixed-2048", "fixed-best", "seq1f1b", "sglang-dynamic"} <= set(
            baselines
        )
        plan = plan_chunks(problem, seeds=[b.chunks for b in baselines.values()])
        for name, base in baselines.items():
            assert plan.ttft_s <= base.ttft_s * (1 + 1e-12), name
            assert sum(base.chunks) == sum(problem.seq_lens)


def test_baselines_respect_the_memory_cap_and_batches() -> None:
    rng = np.random.default_rng(2)
    problem = ChunkProblem(uniform_pipeline(rng, 3), (3000, 1000), 64, max_chunk_tokens=700)
    baselines = baseline_plans(problem)
    assert "none" not in baselines  # a 3000-token piece breaks the cap
    for name, base in baselines.items():
        assert max(base.chunks) <= 700, name
        assert len(base.schedule.request_ttft_s) == 2
