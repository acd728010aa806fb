"""`tessel probe` on a real GPU machine: the GPUs measured, NCCL found, the topology read back
(skipped without CUDA; benchmarks/gpu_checks.sh runs tests/*/test_cuda_*.py)."""

from __future__ import annotations

import pytest
import torch

from tessel.catalog.gpus import get_gpu
from tessel.catalog.local_machine import cluster_data, discover_machine
from tessel.plan.files.cluster import parse_cluster
from tessel.profiling.device_bench import measure_device, nccl_version

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_gpus_measured_against_their_catalog_peaks() -> None:
    machine = discover_machine()
    assert len(machine.gpus) == torch.cuda.device_count(), machine.notes
    peers = [gpu.cuda_index for gpu in machine.gpus]
    for gpu in machine.gpus:
        spec = get_gpu(gpu.gpu_type)
        speeds = measure_device(f"cuda:{gpu.cuda_index}", peers=peers)
        # measured below the datasheet peak, and not absurdly below it
        assert (
            0.05 * spec.peak_flops_per_s["fp16"]
            < speeds.gemm_tflops * 1e12
            < 1.1 * spec.peak_flops_per_s["fp16"]
        )
        assert (
            0.2 * spec.mem_bandwidth_bytes_per_s
            < speeds.memory_gbs * 1e9
            < 1.1 * spec.mem_bandwidth_bytes_per_s
        )
        assert speeds.h2d_gbs > 1 and speeds.d2h_gbs > 1
        assert set(speeds.peer_gbs) == {f"cuda:{k}" for k in peers if k != gpu.cuda_index}
    assert nccl_version() is not None
    if len(machine.gpus) > 1:
        assert machine.topology is not None and machine.topology.gpu_count == len(machine.gpus)
    parse_cluster(cluster_data(machine))
