"""The TTFT lower bound: never above the brute-force optimum; equal to it on one stage."""

from __future__ import annotations

import numpy as np
import pytest
from chunk_pipelines import brute_force, mixed_pipeline, uniform_pipeline

from tessel.chunk.bounds import lower_bound_s
from tessel.chunk.planner import ChunkProblem, plan_chunks

GRID = 16


@pytest.mark.parametrize("n_stages", [1, 2, 4])
def test_bound_below_every_chunking(n_stages: int) -> None:
    rng = np.random.default_rng(40 + n_stages)
    for trial in range(8):
        pipeline = mixed_pipeline(rng, n_stages, scalar_only=bool(trial % 2))
        lens = [int(rng.integers(2, 8)) * GRID - int(rng.integers(0, GRID))]
        if trial % 3 == 0:
            lens.append(int(rng.integers(1, 4)) * GRID)
        cap = None if trial % 4 else 3 * GRID
        best, _ = brute_force(pipeline, lens, GRID, cap)
        problem = ChunkProblem(pipeline, tuple(lens), GRID, max_chunk_tokens=cap, tail_s=0.01)
        bound = lower_bound_s(problem)
        assert bound <= best + 0.01 + 1e-12
        if n_stages == 1:  # one stage: the bound is the optimum
            assert bound == pytest.approx(best + 0.01, rel=1e-12)


def test_bound_is_close_on_long_uniform_prompts() -> None:
    rng = np.random.default_rng(3)
    for n_stages in (2, 4):
        problem = ChunkProblem(uniform_pipeline(rng, n_stages), (96 * GRID,), GRID)
        plan = plan_chunks(problem)
        bound = lower_bound_s(problem)
        assert bound <= plan.ttft_s
        assert plan.ttft_s <= 1.5 * bound  # the bound is informative, not vacuous
