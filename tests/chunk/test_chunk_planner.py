"""The chunk planner against a brute force over every chunking on the grid."""

from __future__ import annotations

import numpy as np
import pytest
from chunk_pipelines import brute_force, mixed_pipeline, naive_makespan, uniform_pipeline

from tessel.chunk.grid import make_grid, surrogate_tables
from tessel.chunk.planner import ChunkProblem, plan_chunks, terapipe_candidates
from tessel.errors import TesselError

GRID = 16


def _random_length(rng: np.random.Generator, max_steps: int) -> int:
    return int(rng.integers(2, max_steps + 1)) * GRID - int(rng.integers(0, GRID))


def _check_against_brute_force(problem: ChunkProblem, plan, rel: float = 1e-9) -> float:
    best, _ = brute_force(
        problem.pipeline, list(problem.seq_lens), problem.grid_tokens, problem.max_chunk_tokens
    )
    value = naive_makespan(problem.pipeline, list(plan.chunks), list(problem.seq_lens))
    assert value == pytest.approx(plan.schedule.makespan_s, rel=1e-12)
    assert value >= best * (1 - 1e-12)  # nothing beats the brute force
    assert value == pytest.approx(best, rel=rel)
    return best


@pytest.mark.parametrize("n_stages", [1, 2, 3, 5])
def test_terapipe_dp_is_optimal_on_uniform_pipelines(n_stages: int) -> None:
    rng = np.random.default_rng(n_stages)
    for _ in range(6):
        problem = ChunkProblem(uniform_pipeline(rng, n_stages), (_random_length(rng, 11),), GRID)
        plan = plan_chunks(problem, exact=False)  # the DP alone carries the proof here
        assert plan.optimal and plan.method == "terapipe-dp"
        _check_against_brute_force(problem, plan)


@pytest.mark.parametrize("scalar_only", [False, True])
def test_exact_search_is_optimal_on_unequal_stages(scalar_only: bool) -> None:
    rng = np.random.default_rng(7 + scalar_only)
    for _ in range(8):
        n_stages = int(rng.integers(2, 6))
        problem = ChunkProblem(mixed_pipeline(rng, n_stages, scalar_only), (_random_length(rng, 11),), GRID)
        plan = plan_chunks(problem, exact=True)
        assert plan.optimal
        _check_against_brute_force(problem, plan)


def test_heuristic_never_worse_than_its_dp_and_close_to_optimal() -> None:
    """Without the exact search: at most 2% above the optimum on these small cases (measured: 0%)."""
    rng = np.random.default_rng(21)
    for _ in range(8):
        problem = ChunkProblem(mixed_pipeline(rng, int(rng.integers(2, 5))), (_random_length(rng, 10),), GRID)
        plan = plan_chunks(problem, exact=False)
        best = _check_against_brute_force(problem, plan, rel=0.02)
        assert plan.schedule.makespan_s <= best * 1.02


def test_batch_dp_is_optimal_and_beats_per_request_splits() -> None:
    rng = np.random.default_rng(4)
    for _ in range(5):
        pipeline = mixed_pipeline(rng, 3)
        lens = (_random_length(rng, 5), _random_length(rng, 4), _random_length(rng, 4))
        problem = ChunkProblem(pipeline, lens, GRID)
        plan = plan_chunks(problem, exact=True)
        assert plan.optimal
        best = _check_against_brute_force(problem, plan)
        per_request = []
        for length in lens:
            per_request += list(plan_chunks(ChunkProblem(pipeline, (length,), GRID), exact=True).chunks)
        assert naive_makespan(pipeline, per_request, list(lens)) >= best * (1 - 1e-12)
        assert len(plan.schedule.request_ttft_s) == 3


def test_memory_cap_is_respected_and_optimal() -> None:
    rng = np.random.default_rng(9)
    for cap in (GRID, 3 * GRID, 5 * GRID - 3):
        for uniform in (True, False):
            pipeline = uniform_pipeline(rng, 3) if uniform else mixed_pipeline(rng, 3)
            problem = ChunkProblem(pipeline, (_random_length(rng, 11),), GRID, max_chunk_tokens=cap)
            plan = plan_chunks(problem, exact=True)
            assert max(plan.chunks) <= cap and plan.optimal
            _check_against_brute_force(problem, plan)


def test_dp_matches_exact_search_on_longer_uniform_prompts() -> None:
    """Past brute force (2^47 chunkings): the DP and the exact Pareto search agree."""
    rng = np.random.default_rng(12)
    for n_stages in (2, 4):
        problem = ChunkProblem(uniform_pipeline(rng, n_stages), (48 * GRID,), GRID)
        dp = plan_chunks(problem, exact=False)
        exact = plan_chunks(problem, exact=True)
        assert dp.method == "terapipe-dp" and exact.optimal
        assert "exact Pareto search proved the plan optimal" in exact.notes
        assert dp.ttft_s == pytest.approx(exact.ttft_s, rel=1e-9)


def test_tau_bisection_finds_the_bound_minimum() -> None:
    """The first DP candidate minimises sum M + (S-1) max U: check against every chunking."""
    rng = np.random.default_rng(13)
    for _ in range(5):
        n_stages = int(rng.integers(2, 5))
        pipeline = mixed_pipeline(rng, n_stages)
        grid = make_grid((_random_length(rng, 11),), GRID)
        m_table, u_table, _ = surrogate_tables(grid, pipeline)
        best = terapipe_candidates(grid, m_table, u_table, n_stages)[0]

        def bound(b: list[int], m_table=m_table, u_table=u_table, n_stages=n_stages) -> float:
            rows, cols = np.asarray(b[1:]), np.diff(b) - 1
            return m_table[rows, cols].sum() + (n_stages - 1) * u_table[rows, cols].max()

        n = grid.n
        every = []
        for mask in range(2 ** (n - 1)):
            every.append([0] + [i for i in range(1, n) if mask >> (i - 1) & 1] + [n])
        assert bound(best) == pytest.approx(min(bound(b) for b in every), rel=1e-12)


def test_bad_inputs_are_user_errors() -> None:
    rng = np.random.default_rng(0)
    pipeline = uniform_pipeline(rng, 2)
    with pytest.raises(TesselError, match="max chunk tokens"):
        plan_chunks(ChunkProblem(pipeline, (1000,), 64, max_chunk_tokens=32))
    with pytest.raises(TesselError, match="positive"):
        plan_chunks(ChunkProblem(pipeline, (0,), 64))
    with pytest.raises(TesselError, match="grid"):
        plan_chunks(ChunkProblem(pipeline, (100,), 0))
