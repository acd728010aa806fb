"""The flow-shop makespan: vectorised recurrence vs the loop, closed forms, offsets and batches."""

from __future__ import annotations

import numpy as np
import pytest
from chunk_pipelines import RooflineStage, mixed_pipeline, naive_makespan, uniform_pipeline

from tessel.chunk.latency import PipelineLatency
from tessel.chunk.schedule import chunk_offsets, evaluate_chunks, flow_shop_finish, makespan_naive


@pytest.mark.parametrize("n_stages,n_chunks", [(1, 1), (1, 7), (3, 1), (4, 9), (7, 13)])
def test_vectorised_recurrence_matches_loops(n_stages: int, n_chunks: int) -> None:
    rng = np.random.default_rng(n_stages * 100 + n_chunks)
    for _ in range(20):
        times = rng.exponential(1.0, (n_stages, n_chunks))
        sends = rng.exponential(0.3, (n_stages, n_chunks))
        sends[-1] = 0.0
        finish = flow_shop_finish(times, sends)
        assert finish[-1, -1] == pytest.approx(makespan_naive(times, sends), rel=1e-12)
        # stage order and chunk order both hold in the finish times
        assert (np.diff(finish, axis=1) >= times[:, 1:] - 1e-12).all()
        assert (finish[1:] >= finish[:-1] + sends[:-1] + times[1:] - 1e-12).all()


def test_batched_recurrence_matches_one_by_one() -> None:
    rng = np.random.default_rng(3)
    times = rng.exponential(1.0, (5, 4, 6))
    sends = rng.exponential(0.2, (5, 4, 6))
    batched = flow_shop_finish(times, sends)
    for r in range(5):
        np.testing.assert_allclose(batched[r], flow_shop_finish(times[r], sends[r]))


def test_uniform_pipeline_closed_form() -> None:
    """Equal stages and links: makespan = sum t_i + (S-1) * max_i (t_i + send_i)."""
    rng = np.random.default_rng(11)
    for n_stages in (1, 2, 3, 6):
        pipeline = uniform_pipeline(rng, n_stages)
        chunks = list(rng.integers(1, 300, size=int(rng.integers(1, 10))))
        schedule = evaluate_chunks(pipeline, chunks)
        t = schedule.stage_times_s[0]
        send = schedule.send_times_s[0] if n_stages > 1 else np.zeros_like(t)
        expected = t.sum() + (n_stages - 1) * (t + send).max()
        assert schedule.makespan_s == pytest.approx(expected, rel=1e-12)


def test_offsets_restart_per_request_and_scalar_stages_agree() -> None:
    rng = np.random.default_rng(5)
    pipeline = mixed_pipeline(rng, 3, scalar_only=True)
    assert isinstance(pipeline.stages[0], RooflineStage)
    seq_lens = [100, 37, 64]
    chunks = [60, 40, 37, 10, 54]
    offsets, request = chunk_offsets(chunks, seq_lens)
    assert offsets.tolist() == [0, 60, 0, 0, 10]
    assert request.tolist() == [0, 0, 1, 2, 2]
    schedule = evaluate_chunks(pipeline, chunks, seq_lens, tail_s=0.25)
    assert schedule.makespan_s == pytest.approx(naive_makespan(pipeline, chunks, seq_lens), rel=1e-12)
    assert schedule.ttft_s == pytest.approx(schedule.makespan_s + 0.25)
    assert len(schedule.request_ttft_s) == 3 and schedule.request_ttft_s[-1] == pytest.approx(schedule.ttft_s)
    assert 0.0 <= schedule.bubble_fraction < 1.0


def test_chunks_must_respect_requests() -> None:
    with pytest.raises(ValueError, match="spans two requests"):
        chunk_offsets([50, 50], [60, 40])
    with pytest.raises(ValueError, match="sum to"):
        chunk_offsets([50, 40], [100])
    with pytest.raises(ValueError):
        PipelineLatency(())
