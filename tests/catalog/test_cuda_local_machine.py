"""Discovery on a real GPU machine: the real nvidia-smi against what torch sees (skipped without CUDA).

benchmarks/gpu_checks.sh runs tests/*/test_cuda_*.py; on a machine without a GPU these skip, and the
logic is held by tests/catalog/test_local_machine.py on recorded nvidia-smi output.
"""

from __future__ import annotations

import pytest
import torch

from tessel.catalog.gpus import get_gpu
from tessel.catalog.local_machine import cluster_data, discover_machine
from tessel.plan.files.cluster import cap_gpu_memory, parse_cluster

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_discovery_agrees_with_torch() -> None:
    machine = discover_machine()
    assert len(machine.gpus) == torch.cuda.device_count(), machine.notes
    for gpu in machine.gpus:
        properties = torch.cuda.get_device_properties(gpu.cuda_index)
        assert gpu.name == properties.name  # cuda:K is the device the plan calls localhost/gpu<K>
        assert abs(gpu.memory_bytes - properties.total_memory) <= 0.02 * gpu.memory_bytes
        get_gpu(gpu.gpu_type)
    cluster = parse_cluster(cluster_data(machine))
    assert [d.name for d in cluster.devices] == [f"localhost/gpu{k}" for k in range(len(machine.gpus))] + [
        "localhost-cpu/gpu0"
    ]
    capped = cap_gpu_memory(cluster, 1.0)
    assert all(d.spec.usable_bytes == 2**30 for d in capped.devices if d.gpu_type != "cpu")
