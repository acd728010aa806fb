"""A launch command for unmodified vLLM that follows a tessel plan as far as vLLM can.

vLLM pipeline parallelism takes per-stage layer counts from `VLLM_PP_LAYER_PARTITION` (read by
`vllm.distributed.utils.get_pp_indices`) and `--pipeline-parallel-size`. What it cannot follow is
reported as a warning, never silently dropped:

- sublayer stages: vLLM splits whole layers, so a layer split across two stages goes to the stage
  that holds its attention block;
- offloading: vLLM's `--cpu-offload-gb` is one number for every GPU, not a per-stage amount;
- idle devices and pipeline order: vLLM runs exactly one stage per GPU it is given and orders
  ranks by its own placement (node by node), so unused GPUs must be hidden (CUDA_VISIBLE_DEVICES)
  and an order that hops between nodes may not be reproduced;
- precision per layer: vLLM loads one quantisation scheme for the whole checkpoint, so a plan that
  mixes precisions is reported with the precisions it uses; the checkpoint given to vLLM decides;
- KV capacity: vLLM gives every stage the same number of KV blocks, so the token capacity is set by
  the stage with the least free memory per layer it holds:
      tokens_j = (memory_j * GPU_MEMORY_UTILIZATION - weights_j - workspace_j)
                 / (kv_per_token_layer * layers_j)
  and capacity = min_j tokens_j (reported, with the stage that sets it);
- tensor-parallel stages: vLLM takes one `--tensor-parallel-size` for every stage. When every stage
  has the same degree it is written as is; when they differ the smallest degree is written (every
  stage can run on that many of its GPUs) and the warning names the stages that lose GPUs and what
  that costs: their weights and KV on fewer GPUs (the KV capacity above is computed on those), so
  the plan's times and memory do not hold for them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import Evaluation

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
VLLM_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True, slots=True)
class VllmExport:
    command: str
    layer_counts: list[int]
    kv_capacity_tokens: int
    kv_limiting_stage: int
    tokens_needed: int | None
    warnings: list[str]


def _model_id(model) -> str:
    source = getattr(model, "source", "") or ""
    if source.endswith(" config.json"):
        return source.removesuffix(" config.json")  # preset: the HF repo
    if source.endswith("config.json"):
        return source.removesuffix("config.json").rstrip("/") or "."
    return source or model.name


def export_vllm(
    instance: PlanningInstance,
    evaluation: Evaluation,
    *,
    model,
    dtype: str = "fp16",
    kv_dtype: str = "fp16",
    max_model_len: int | None = None,
    tokens_needed: int | None = None,
) -> VllmExport:
    from tessel.cost.layer import kv_bytes_per_token

    warnings: list[str] = []
    stages = [se.stage for se in evaluation.stages]
    # whole layers per stage: a layer belongs to the stage holding its first unit
    owner_of_layer: dict[int, int] = {}
    for index, stage in enumerate(stages):
        for unit in instance.units[stage.unit_start : stage.unit_end]:
            owner_of_layer.setdefault(unit.layer, index)
    counts = [0] * len(stages)
    for index in owner_of_layer.values():
        counts[index] += 1
    split = [s.unit_start for s in stages if instance.units[s.unit_start].kind == "mlp"]
    if split:
        warnings.append(
            f"{len(split)} layer(s) are split between stages (sublayer plan); vLLM places whole layers, so "
            "each goes to the stage holding its attention block"
        )
    empty = [i for i, c in enumerate(counts) if c == 0]
    if empty:
        warnings.append(f"stage(s) {empty} hold no whole layer and would be empty in vLLM")
    offload = [se for se in evaluation.stages if se.offload_bytes > 0]
    cpu_offload_gb = 0.0
    if offload:
        cpu_offload_gb = max(se.offload_bytes for se in offload) / 1e9
        warnings.append(
            f"{len(offload)} stage(s) offload to host memory; vLLM's --cpu-offload-gb applies one amount to "
            f"every GPU, so it is set to the largest ({cpu_offload_gb:.1f} GB)"
        )
    if evaluation.precisions is not None and len(set(evaluation.precisions)) > 1:
        mix = ", ".join(
            f"{name} on {evaluation.precisions.count(name)} units"
            for name in sorted(set(evaluation.precisions))
        )
        warnings.append(
            f"the plan mixes weight precisions ({mix}); vLLM applies one quantisation to the whole "
            "checkpoint, so it cannot follow a mixed plan: serve a checkpoint quantised per layer as planned "
            "with tessel's runtime, or the predicted speed will not hold"
        )
    tp_size, tp_warning = _tensor_parallel_size(instance, stages)
    if tp_warning:
        warnings.append(tp_warning)
    used = {s.device for s in stages}
    idle = [gpu for j, d in enumerate(instance.devices) if j not in used for gpu in d.gpus]
    if idle:
        warnings.append(
            f"{len(idle)} GPU(s) stay idle ({', '.join(idle)}); hide them with CUDA_VISIBLE_DEVICES"
        )
    nodes = [instance.devices[s.device].node for s in stages]
    hops = sum(1 for a, b in zip(nodes, nodes[1:], strict=False) if a != b)
    if hops > len(set(nodes)) - 1:
        warnings.append(
            f"the pipeline crosses between nodes {hops} times; vLLM orders ranks node by node, so it may not "
            "reproduce this order"
        )
    # KV capacity as vLLM sizes it
    per_token_layer = kv_bytes_per_token(model, kv_dtype)
    capacities = []
    for index, se in enumerate(evaluation.stages):
        device = instance.devices[se.stage.device]
        memory = device.memory_bytes / device.tp_degree * tp_size  # on the GPUs vLLM gives it
        free = memory * GPU_MEMORY_UTILIZATION - se.weight_bytes - se.workspace_bytes
        layers = max(counts[index], 1)
        capacities.append(max(free, 0.0) / (per_token_layer * layers))
    limiting = min(range(len(capacities)), key=capacities.__getitem__)
    capacity = int(capacities[limiting])
    if tokens_needed is not None and capacity < tokens_needed:
        warnings.append(
            f"vLLM's KV capacity is {capacity} tokens (set by stage {limiting}, "
            f"{instance.devices[stages[limiting].device].name}), less than the {tokens_needed} tokens "
            "the workload "
            "keeps in flight; vLLM will queue or preempt requests"
        )
    env = f"VLLM_PP_LAYER_PARTITION={','.join(str(c) for c in counts)}"
    args = [
        "vllm",
        "serve",
        _model_id(model),
        "--pipeline-parallel-size",
        str(len(stages)),
        "--tensor-parallel-size",
        str(tp_size),
    ]
    if dtype in VLLM_DTYPES:
        args += ["--dtype", VLLM_DTYPES[dtype]]
    else:
        warnings.append(f"dtype {dtype} has no vLLM --dtype; quantised checkpoints set it themselves")
    if kv_dtype == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    args += ["--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION)]
    if cpu_offload_gb > 0:
        args += ["--cpu-offload-gb", f"{cpu_offload_gb:.1f}"]
    if len(set(nodes)) > 1:
        args += ["--distributed-executor-backend", "ray"]
    command = env + " " + " ".join(shlex.quote(a) for a in args)
    return VllmExport(command, counts, capacity, limiting, tokens_needed, warnings)


def _tensor_parallel_size(instance: PlanningInstance, stages) -> tuple[int, str | None]:
    """vLLM's one tensor-parallel degree for the plan's stages, and what is lost when they differ."""
    degrees = [instance.devices[s.device].tp_degree for s in stages]
    size = min(degrees)
    if len(set(degrees)) == 1:
        return size, None
    cut = [f"{i} ({instance.devices[s.device].name}: {d} -> {size} GPUs)" for i, (s, d) in enumerate(
        zip(stages, degrees, strict=True)) if d > size]  # fmt: skip
    return size, (
        f"the plan's stages have tensor-parallel degrees {','.join(map(str, degrees))}; vLLM runs one degree "
        f"on every stage, so --tensor-parallel-size {size} (the smallest) is written and stage(s) "
        f"{', '.join(cut)} run on fewer GPUs than planned: their weights and KV per GPU grow by the ratio "
        "and their compute slows by it, so the plan's memory check and predicted times do not hold there"
    )


def closest_disjoint_paths(plan) -> tuple[list[int], list[float], list[str]]:
    """What vLLM can run of a flow plan (`tessel.plan.flow.flow.FlowPlan`): pipelines that share no
    device, each one vLLM instance behind a weighted load balancer. Paths are taken by routing
    weight, skipping any that shares a device with one taken. Returns (path indices, their
    load-balancer weights summing to 1, warnings saying what is lost)."""
    taken, used = [], set()
    for index in sorted(range(len(plan.paths)), key=lambda i: -plan.paths[i].weight):
        devices = set(plan.paths[index].devices)
        if devices & used:
            continue
        taken.append(index)
        used |= devices
    kept = sum(plan.paths[i].weight for i in taken)
    weights = [plan.paths[i].weight / kept for i in taken]
    warnings = []
    if len(taken) < len(plan.paths):
        warnings.append(
            "vLLM cannot route requests over shared placements (one GPU serving several pipelines, "
            f"flow weights per edge): exported {len(taken)} of the plan's {len(plan.paths)} paths, the ones "
            f"sharing no GPU, as separate replicas; they carried {kept * 100:.1f}% of the requests, and "
            "their load-balancer weights are rescaled to sum to 1"
        )
    warnings.append(
        "each exported replica is a vLLM pipeline of its own: its GPUs' time is not shared with other "
        "paths as in the plan, so its throughput is its own pipeline's, not the flow plan's"
    )
    return taken, weights, warnings
