"""Where stages run and how the stream crosses each link (`tessel.pipeline.devices`), on any machine:
the GPUs are described, not probed. Oracle: the table in the module's docstring."""

from __future__ import annotations

import pytest

from tessel.errors import TesselError
from tessel.pipeline.devices import (
    HOST,
    NCCL,
    CudaDevice,
    check_devices,
    link_lines,
    link_transports,
    process_group_backend,
    same_gpu_type,
    stage_device,
)
from tessel.pipeline.run_plan import RunPlan, RunStage
from tessel.pipeline.stage.runner import KvBudget

GIB = 2**30
H100 = CudaDevice(0, "NVIDIA H100 80GB HBM3", 80 * GIB)
T4 = CudaDevice(1, "Tesla T4", 15 * GIB)


def stage(index, device, kind, weights=None, kv=None):
    return RunStage(index, device, kind, index, index + 1, weights_gib=weights, kv_gib=kv)


def plan(*stages) -> RunPlan:
    return RunPlan(None, "m", len(stages), tuple(stages), 2, None)


def test_a_tensor_parallel_stage_needs_every_ranks_gpu():
    """Rank r runs on tp_gpus[r], and holds 1/d of the stage's planned weights and KV (its ranks' sum)."""
    from dataclasses import replace

    second = CudaDevice(2, "NVIDIA H100 80GB HBM3", 80 * GIB)
    tp = replace(stage(0, "a/gpu0", "H100", 120.0, 20.0), tp_degree=2, tp_gpus=(0, 2))
    check_devices(plan(tp), [H100, T4, second])  # 70 GiB on each H100
    with pytest.raises(TesselError, match=r"stage 0 runs on a/gpu0's rank 1 \(cuda:2\) \(H100\), but"):
        check_devices(plan(tp), [H100, T4])
    with pytest.raises(TesselError, match=r"a H100 on a/gpu0's rank 1 \(cuda:1\), but cuda:1 is a Tesla T4"):
        check_devices(plan(replace(tp, tp_gpus=(0, 1))), [H100, T4])
    with pytest.raises(TesselError, match=r"share cuda:0 .* 85.0 GiB"):
        check_devices(plan(replace(tp, weights_gib=150.0)), [H100, T4, second])


@pytest.mark.parametrize(
    ("device", "kind", "torch_device"),
    [
        ("localhost/gpu0", "cpu", "cpu"),
        ("localhost-cpu/gpu0", "cpu", "cpu"),
        ("localhost/gpu0", "H100", "cuda:0"),
        ("node-7/gpu3", "A100-80G", "cuda:3"),
        ("localhost/gpu1#2", "T4", "cuda:1"),  # a second stage on GPU 1
    ],
)
def test_stage_device_from_the_plan(device, kind, torch_device):
    assert stage_device(stage(0, device, kind)) == torch_device


def test_a_gpu_stage_without_an_index_is_refused():
    with pytest.raises(TesselError, match="names no GPU index"):
        stage_device(stage(0, "localhost/big", "H100"))


@pytest.mark.parametrize(
    ("devices", "transports"),
    [
        ([("a/gpu0", "cpu"), ("a/gpu1", "cpu")], [HOST]),
        ([("a/gpu0", "H100"), ("a/gpu1", "H100")], [NCCL]),  # two GPUs
        ([("a/gpu0", "H100"), ("b/gpu0", "H100")], [NCCL]),  # GPU 0 of two nodes
        ([("a/gpu0", "H100"), ("a/gpu0#2", "H100")], [HOST]),  # one GPU shared
        ([("a-cpu/gpu0", "cpu"), ("a/gpu0", "H100")], [HOST]),  # CPU -> GPU
        ([("a/gpu0", "H100"), ("a/gpu1", "T4"), ("a-cpu/gpu0", "cpu")], [NCCL, HOST]),
    ],
)
def test_transport_per_link(devices, transports):
    p = plan(*(stage(i, d, k) for i, (d, k) in enumerate(devices)))
    assert link_transports(p) == transports
    assert process_group_backend(transports) == ("cpu:gloo,cuda:nccl" if NCCL in transports else "gloo")
    assert link_transports(p, "host") == [HOST] * len(transports)
    assert len(link_lines(p, transports)) == len(transports)


@pytest.mark.parametrize(
    ("devices", "why"),
    [
        ([("a-cpu/gpu0", "cpu"), ("a/gpu0", "H100")], "a CPU stage has no NCCL"),
        ([("a/gpu0", "H100"), ("a/gpu0#2", "H100")], "both stages share one GPU"),
    ],
)
def test_nccl_where_it_cannot_run_is_refused(devices, why):
    p = plan(*(stage(i, d, k) for i, (d, k) in enumerate(devices)))
    with pytest.raises(TesselError, match=why):
        link_transports(p, "nccl")


def test_an_unknown_transport_is_refused():
    with pytest.raises(TesselError, match="--transport must be one of"):
        link_transports(plan(stage(0, "a/gpu0", "cpu")), "rdma")


def test_the_machine_must_have_the_planned_gpus():
    p = plan(stage(0, "a-cpu/gpu0", "cpu"), stage(1, "a/gpu1", "T4"))
    check_devices(p, [H100, T4])  # fits
    with pytest.raises(TesselError, match=r"runs on a/gpu1 \(T4\), but this machine has no CUDA GPU"):
        check_devices(p, [])
    with pytest.raises(TesselError, match=r"this machine has cuda:0 NVIDIA H100"):
        check_devices(p, [H100])
    with pytest.raises(TesselError, match="planned for a H100 on a/gpu0, but cuda:0 is a Tesla T4"):
        check_devices(plan(stage(0, "a/gpu0", "H100")), [CudaDevice(0, "Tesla T4", 15 * GIB)])
    check_devices(p, [], ranks=[0])  # under torchrun a stage checks its own device only


def test_stages_sharing_a_gpu_must_fit_in_it():
    ok = plan(stage(0, "a/gpu1", "T4", 6.0, 2.0), stage(1, "a/gpu1#2", "T4", 5.0, 1.5))
    check_devices(ok, [H100, T4])
    big = plan(stage(0, "a/gpu1", "T4", 8.0, 2.0), stage(1, "a/gpu1#2", "T4", 5.0, 1.5))
    with pytest.raises(TesselError, match=r"share cuda:1 \(Tesla T4, 15.0 GiB\) .* 16.5 GiB .* 1.5 GiB more"):
        check_devices(big, [H100, T4])


@pytest.mark.parametrize(
    ("kind", "name", "same"),
    [
        ("H100", "NVIDIA H100 80GB HBM3", True),
        ("A100-80G", "NVIDIA A100-SXM4-80GB", True),
        ("T4", "Tesla T4", True),
        ("A100-80G", "NVIDIA H100 80GB HBM3", False),
        ("V100", "Tesla T4", False),
    ],
)
def test_catalog_types_against_device_names(kind, name, same):
    assert same_gpu_type(kind, name) is same


def test_kv_budget_per_stage():
    """--kv-cache-gib is the pipeline's: a stage takes its layers' share (the blocks one process
    would have); else the plan's kv_gib for the stage, capped at what max_num_seqs full sequences
    need; never fewer blocks than one sequence needs."""
    per_block = 2**20  # 1 MiB per block of this stage's layers
    assert KvBudget(1.0, None, 0.25).blocks(per_block, 4, 256) == 256
    assert KvBudget(None, 0.5, 0.25).blocks(per_block, 4, 256) == 512
    assert KvBudget(None, 0.5, 0.25).blocks(per_block, 4, 8) == 32  # 8 sequences of 4 blocks
    assert KvBudget(None, None, 0.5).blocks(per_block, 4, 10_000) == 1024  # half the 2 GiB default
    assert KvBudget(None, 0.0001, 1.0).blocks(per_block, 4, 256) == 4
