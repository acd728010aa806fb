"""The memory bound's program with alike devices merged (one column set per class, counted) has
the optimum of the program with a column set per device."""

from __future__ import annotations

import pytest

from tessel.plan.build import build_instance
from tessel.plan.files.workload import load_workload
from tessel.plan.solvers.memory_bound import memory_flow_bound


@pytest.mark.parametrize(
    ("model", "cluster", "cap"),
    [
        ("llama-2-13b", "llmpq-t4-v100", None),
        ("llama-2-13b", "llmpq-t4-v100", 3),
        ("llama-2-7b", "llmpq-t4-v100-a100", None),
    ],
)
def test_merged_alike_devices_keep_the_optimum(model: str, cluster: str, cap: int | None) -> None:
    workload = load_workload("offline-batch")
    instance = build_instance(model, cluster, workload)
    b = workload.micro_batch_size
    merged = memory_flow_bound(instance, b, max_micro_batches=cap)
    full = memory_flow_bound(instance, b, max_micro_batches=cap, aggregate=False, time_limit_s=120.0)
    assert merged.status == full.status == "Optimal"
    assert merged.throughput_tok_s == pytest.approx(full.throughput_tok_s, rel=1e-6)
