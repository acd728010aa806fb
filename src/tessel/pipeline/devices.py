"""Where each stage runs and how hidden states cross each link between stages.

A plan's stage names its device as `<node>/gpu<K>` with a catalog type: type `cpu` runs on the CPU,
any other on CUDA device K of its node. Two stages may share one GPU under two names,
`<node>/gpu<K>` and `<node>/gpu<K>#2` (a plan file names each device once). Before any process
starts, `check_devices` refuses a plan this machine cannot run, saying what differs: a GPU index it
does not have, a GPU of another type than the plan's, stages sharing one GPU that cannot hold their
planned weights and KV.

Per link (stage k -> k + 1) the transport is:

    both stages on CUDA, on different GPUs     "nccl": the stream goes GPU to GPU (NCCL isend/irecv)
    anything else (a CPU end, or one GPU       "host": the stream is copied into a pinned host buffer,
    shared by both stages)                     sent over gloo, copied onto the receiver's device

NCCL cannot link two processes on one GPU, nor a GPU with a CPU. Headers, the batch metadata and
the sampled tokens always travel over gloo as small host tensors. A process group with a NCCL link
is created with the backend "cpu:gloo,cuda:nccl" (each tensor's device picks its backend); without
one, gloo alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tessel.errors import TesselError
from tessel.pipeline.run_plan import RunPlan, RunStage
from tessel.plan.files.plan_parts import gpu_index

NCCL, HOST = "nccl", "host"
TRANSPORTS = ("auto", NCCL, HOST)


@dataclass(frozen=True, slots=True)
class CudaDevice:
    """One GPU this machine has: its CUDA index, its name and its memory."""

    index: int
    name: str
    total_bytes: int


def node_of(stage: RunStage) -> str:
    return stage.device.split("/", 1)[0] if "/" in stage.device else ""


def stage_device(stage: RunStage) -> str:
    """The stage's torch device: "cpu", or "cuda:K" for the GPU the plan names `<node>/gpu<K>`."""
    if not stage.is_cuda:
        return "cpu"
    index = gpu_index(stage.device)
    if index is None:
        raise TesselError(
            f"stage {stage.index}: device {stage.device!r} ({stage.gpu_type}) names no GPU index; "
            "a GPU stage's device is <node>/gpu<K>"
        )
    return f"cuda:{index}"


def link_transport(sender: RunStage, receiver: RunStage, forced: str = "auto") -> str:
    """How the stream crosses the link sender -> receiver: NCCL between two different GPUs, else
    pinned host buffers over gloo. `forced` ("nccl" or "host") asks for one; NCCL where it cannot
    run is refused."""
    gpus = sender.is_cuda and receiver.is_cuda
    shared = gpus and node_of(sender) == node_of(receiver) and stage_device(sender) == stage_device(receiver)
    nccl_possible = gpus and not shared
    if forced == NCCL and not nccl_possible:
        why = "both stages share one GPU" if shared else "a CPU stage has no NCCL"
        raise TesselError(
            f"--transport nccl: the link stage {sender.index} ({sender.device}, {sender.gpu_type}) -> "
            f"stage {receiver.index} ({receiver.device}, {receiver.gpu_type}) cannot use NCCL ({why}); "
            "use --transport auto or host"
        )
    if forced == HOST:
        return HOST
    return NCCL if nccl_possible else HOST


def link_transports(plan: RunPlan, forced: str = "auto") -> list[str]:
    """The transport of each link stage k -> k + 1."""
    if forced not in TRANSPORTS:
        raise TesselError(f"--transport must be one of {', '.join(TRANSPORTS)}, got {forced!r}")
    stages = plan.stages
    return [link_transport(stages[k], stages[k + 1], forced) for k in range(len(stages) - 1)]


def process_group_backend(transports: list[str]) -> str:
    """gloo alone, or gloo for host tensors and NCCL for CUDA tensors where a link uses NCCL."""
    return "cpu:gloo,cuda:nccl" if NCCL in transports else "gloo"


def link_lines(plan: RunPlan, transports: list[str]) -> list[str]:
    """One line per link, as `tessel launch` prints them at start (a tensor-parallel stage with its
    degree: `cpu, TP 2`)."""

    def where(stage: RunStage) -> str:
        return stage_device(stage) + (f", TP {stage.tp_degree}" if stage.tp_degree > 1 else "")

    lines = []
    for k, transport in enumerate(transports):
        a, b = plan.stages[k], plan.stages[k + 1]
        how = "NCCL, GPU to GPU" if transport == NCCL else "gloo over pinned host buffers"
        if transport == HOST and not (a.is_cuda or b.is_cuda):
            how = "gloo, host memory"
        lines.append(f"stage {k} ({where(a)}) -> stage {k + 1} ({where(b)}): {how}")
    return lines


def check_devices(plan: RunPlan, gpus: list[CudaDevice], ranks: list[int] | None = None) -> None:
    """Refuse, before any process starts, stages this machine's `gpus` cannot run (`ranks`: only
    those stages, e.g. the ones on this node; default all). A tensor-parallel stage needs every
    rank's GPU (`tp_gpus`), each holding 1/d of the stage's planned weights and KV."""
    stages = [plan.stages[r] for r in (range(len(plan.stages)) if ranks is None else ranks)]
    by_index = {gpu.index: gpu for gpu in gpus}
    planned: dict[int, list[RunStage]] = {}
    for stage in stages:
        device = stage_device(stage)
        if device == "cpu":
            continue
        for rank, index in enumerate(stage.tp_gpus or (int(device.split(":")[1]),)):
            where = stage.device if rank == 0 else f"{stage.device}'s rank {rank} (cuda:{index})"
            gpu = by_index.get(index)
            if gpu is None:
                have = ", ".join(f"cuda:{g.index} {g.name}" for g in gpus) or "no CUDA GPU"
                raise TesselError(
                    f"stage {stage.index} runs on {where} ({stage.gpu_type}), but this machine has "
                    f"{have}; re-plan for this machine (tessel plan --cluster local)"
                )
            if not same_gpu_type(stage.gpu_type, gpu.name):
                raise TesselError(
                    f"stage {stage.index} was planned for a {stage.gpu_type} on {where}, but cuda:{index} "
                    f"is a {gpu.name}; re-plan for this machine (tessel plan --cluster local)"
                )
            planned.setdefault(index, []).append(stage)
    for index, sharing in planned.items():
        _check_fits(by_index[index], sharing)


def _check_fits(gpu: CudaDevice, stages: list[RunStage]) -> None:
    """The planned weights + KV of the stages on one GPU against its memory (a tensor-parallel stage's
    figures are its ranks' sum: each rank holds 1/d)."""
    need = sum(((stage.weights_gib or 0.0) + (stage.kv_gib or 0.0)) / stage.tp_degree for stage in stages)
    have = gpu.total_bytes / 2**30
    if need > have:
        names = ", ".join(str(s.index) for s in stages)
        raise TesselError(
            f"stages {names} share cuda:{gpu.index} ({gpu.name}, {have:.1f} GiB) but were planned "
            f"{need:.1f} GiB of weights and KV, {need - have:.1f} GiB more than it has"
        )


def same_gpu_type(catalog_type: str, device_name: str) -> bool:
    """Whether a catalog GPU type ("H100", "A100-80G", "T4") names the device `torch.cuda` reports
    ("NVIDIA H100 80GB HBM3"): the type's model part appears in the name."""
    model = re.split(r"[-_ ]", catalog_type.strip())[0].upper()
    return bool(model) and model in device_name.upper()


def cuda_devices() -> list[CudaDevice]:
    """The GPUs torch sees on this machine (none without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append(CudaDevice(index, props.name, int(props.total_memory)))
    return found
