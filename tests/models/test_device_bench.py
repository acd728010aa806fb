"""Device microbenchmarks (tessel.profiling.device_bench): their logic on CPU, the CPU measured for real
(figures only checked for sense: this machine is shared), and the CUDA choices without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from tessel.errors import TesselError
from tessel.profiling.device_bench import (
    CPU_SETTINGS,
    CUDA_SETTINGS,
    BenchSettings,
    device_kind,
    gemm_flops,
    measure_device,
    nccl_version,
    settings_for,
)

SMALL = BenchSettings(gemm_size=128, gemm_dtype="float32", copy_bytes=2**22, transfer_bytes=2**22, repeats=2)


def test_device_strings_and_their_settings() -> None:
    assert [device_kind(d) for d in ("cpu", "cuda", "cuda:3")] == ["cpu", "cuda", "cuda"]
    for bad in ("gpu", "cuda:x", "cpu:0", "mps"):
        with pytest.raises(TesselError, match="cpu, cuda or cuda:<index>"):
            device_kind(bad)
    assert settings_for("cpu") is CPU_SETTINGS and settings_for("cuda:1") is CUDA_SETTINGS
    assert CUDA_SETTINGS.gemm_dtype == "float16" and CPU_SETTINGS.gemm_dtype == "float32"
    assert gemm_flops(1024) == 2 * 1024**3
    with pytest.raises(TesselError, match="positive"):
        BenchSettings(gemm_size=0, gemm_dtype="float32", copy_bytes=1, transfer_bytes=1)


def test_the_cpu_is_measured_for_real() -> None:
    speeds = measure_device("cpu", settings=SMALL)
    assert speeds.device == "cpu" and speeds.gemm_dtype == "float32"
    assert math.isfinite(speeds.gemm_tflops) and speeds.gemm_tflops > 0
    assert math.isfinite(speeds.memory_gbs) and speeds.memory_gbs > 0
    assert speeds.h2d_gbs is None and speeds.peer_gbs == {}  # no host<->device copies on the CPU
    assert speeds.as_dict()["settings"]["gemm_size"] == 128


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_and_nccl_is_none() -> None:
    with pytest.raises(TesselError, match="no CUDA device"):
        measure_device("cuda:0", settings=SMALL)
    assert nccl_version() is None
