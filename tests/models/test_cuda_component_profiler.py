"""The component profiler on a GPU: the ends timed with CUDA events, the host (pinned buffer) and,
with two GPUs, the NCCL transport. Skipped without CUDA (benchmarks/gpu_checks.sh runs it)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tessel.profiling import components as C  # noqa: E402
from tessel.profiling.layer import ProfileSettings  # noqa: E402
from tessel.profiling.timing import make_clock  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = ProfileSettings(device="cuda", dtype="fp16", repeats=2, warmup=1, min_point_s=0.0)


def test_ends_on_cuda_are_timed_at_every_size() -> None:
    sizes, times = C.measure_ends(C.EndsShape(256, 4096), CUDA, make_clock("cuda"))
    assert list(sizes["head"]) == list(C.HEAD_ROWS)
    assert all((t > 0).all() and np.isfinite(t).all() for t in times.values())


def test_host_transport_goes_through_pinned_buffers() -> None:
    sizes, times, _ = C.measure_transport("host", CUDA, sizes=(4096, 1 << 20), rounds=2)
    assert list(sizes) == [4096, 1 << 20] and (times > 0).all()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between stages needs two GPUs")
def test_nccl_transport_between_two_gpus() -> None:
    sizes, times, _ = C.measure_transport("nccl", CUDA, sizes=(4096, 1 << 20), rounds=2)
    assert (times > 0).all()
