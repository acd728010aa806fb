"""Decode points timed as replayed CUDA graphs (`tessel.profiling.cuda_graph_timing`): the replay does
the step's work, and the layer profile takes it. The CUDA tests are skipped without a GPU
(benchmarks/gpu_checks.sh runs them); the choice between eager and replay is checked everywhere."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tessel.profiling.cuda_graph_timing import decode_step  # noqa: E402
from tessel.profiling.layer import LayerShape, ProfileSettings, measure_layer  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_eager_timing_times_the_step_itself() -> None:
    def step() -> None:
        pass

    assert decode_step(step, cuda_graphs=False) is step


@needs_cuda
def test_replay_repeats_the_captured_work() -> None:
    x = torch.zeros(4, device="cuda")
    replay = decode_step(lambda: x.add_(1), cuda_graphs=True)
    torch.cuda.synchronize()
    before = x.clone()
    replay()
    replay()
    torch.cuda.synchronize()
    assert torch.equal(x, before + 2)  # each replay adds one, as the captured step did


@needs_cuda
def test_layer_decode_points_time_as_graphs() -> None:
    settings = ProfileSettings(
        device="cuda", dtype="bf16", budget_s=2.0, repeats=2, warmup=1, min_point_s=0.0,
        max_chunk_tokens=64, max_offset_tokens=128, max_decode_context=128, max_decode_batch=8,
        cuda_graphs=True,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="capturing a decode point")  # a failed capture fails
        data = measure_layer(LayerShape(256, 512, 4, 2, 64), settings)
    assert len(data.decode_times_s) and np.isfinite(data.decode_times_s).all()
    assert (data.decode_times_s > 0).all()
