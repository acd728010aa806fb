"""The plan on the surviving stages of a serving pipeline (torch-free: the runtime's remap calls it).

`survivor_plan(plan, lost)` is the plan a pipeline falls back to when stages `lost` are gone: the
same model on the other stages' devices. When the plan's cluster (a cluster file or a bundled name)
and workload can be read back, the planner (`tessel.plan.api.make_plan`, `PLAN_TIME_LIMIT_S`) plans
it on that cluster without the lost devices; otherwise the survivors keep their order and the
layers are split over them in proportion to their memory (`split_by_memory`; a device's memory is
its cluster entry's, else the catalog's for its GPU type). When the survivors cannot hold the
model, `SurvivorsTooSmallError` says how much they hold and how much is needed.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

from tessel.catalog.gpus import get_gpu
from tessel.catalog.models import ModelSpec
from tessel.cost.layer import embedding_bytes, lm_head_bytes, weight_bytes
from tessel.errors import TesselError
from tessel.plan.api import PlanSettings, make_plan
from tessel.plan.files.cluster import list_bundled_clusters, load_cluster
from tessel.plan.files.plan_file import PlanFile
from tessel.plan.files.plan_parts import PlanStage
from tessel.plan.files.workload import Workload, parse_workload

PLAN_TIME_LIMIT_S = 5.0  # the planner's time on the survivors: the pipeline is down meanwhile


class SurvivorsTooSmallError(TesselError):
    """The stages left after a loss cannot hold the model: the pipeline cannot continue."""

    recovery = "none"


def device_usable_bytes(plan: PlanFile, stage: PlanStage) -> int:
    """Memory the stage's device offers for weights and KV: its cluster entry when the plan's
    cluster (file or bundled name) can be read, else the catalog's for its GPU type."""
    source = plan.cluster.source or plan.cluster.name
    try:
        if source in list_bundled_clusters() or Path(source).is_file():
            return load_cluster(source).device(stage.device).spec.usable_bytes
    except (TesselError, OSError):
        pass  # a cluster that does not name this device (a hand-written plan): use the catalog
    return get_gpu(stage.gpu_type).usable_bytes


def _layer_bytes(spec: ModelSpec, plan: PlanFile) -> list[float]:
    """Weight bytes of each decoder layer at the plan's precisions (its dtype where it gives none)."""
    per_layer = plan.units_per_layer
    precision = [plan.dtype] * (spec.num_layers * per_layer)
    for stage in plan.stages:
        precision[stage.unit_start : stage.unit_end] = stage.unit_precisions(plan.dtype)
    if per_layer == 1:
        return [weight_bytes(spec, "layer", p) for p in precision]
    return [
        weight_bytes(spec, "attention", precision[2 * i]) + weight_bytes(spec, "mlp", precision[2 * i + 1])
        for i in range(spec.num_layers)
    ]


def split_by_memory(
    layer_bytes: list[float], usable: list[int], first_bytes: float, last_bytes: float
) -> list[tuple[int, int]] | None:
    """Contiguous layer ranges, one per device in order, in proportion to `usable` (largest
    remainder, at least one layer each); when that does not fit, the fitting split whose fullest
    device is least full (`_balanced_fit`). `first_bytes` / `last_bytes`: the embedding and the LM
    head. None when no split fits."""
    num_layers, n = len(layer_bytes), len(usable)
    if n == 0 or num_layers < n:
        return None
    total = sum(usable)
    quotas = [num_layers * u / total for u in usable]
    counts = [max(1, math.floor(q)) for q in quotas]
    by_remainder = sorted(range(n), key=lambda i: quotas[i] - math.floor(quotas[i]), reverse=True)
    for i in by_remainder * num_layers:
        if sum(counts) >= num_layers:
            break
        counts[i] += 1
    while sum(counts) > num_layers:
        i = max((i for i in range(n) if counts[i] > 1), key=lambda i: counts[i] - quotas[i])
        counts[i] -= 1
    split = _ranges(counts)
    if _fits(split, layer_bytes, usable, first_bytes, last_bytes):
        return split
    return _balanced_fit(layer_bytes, usable, first_bytes, last_bytes)


def _ranges(counts: list[int]) -> list[tuple[int, int]]:
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def _held(split, layer_bytes, first_bytes, last_bytes) -> list[float]:
    held = [sum(layer_bytes[a:b]) for a, b in split]
    held[0] += first_bytes
    held[-1] += last_bytes
    return held


def _fits(split, layer_bytes, usable, first_bytes, last_bytes) -> bool:
    held = _held(split, layer_bytes, first_bytes, last_bytes)
    return all(h <= u for h, u in zip(held, usable, strict=True))


def _balanced_fit(layer_bytes, usable, first_bytes, last_bytes) -> list[tuple[int, int]] | None:
    """The split (at least one layer per device) whose fullest device is least full, relative to its
    memory, among those that fit: a DP over (device, first layer); None when none fits."""
    n, num_layers = len(usable), len(layer_bytes)
    prefix = [0.0, *itertools.accumulate(layer_bytes)]

    def fill(k: int, a: int, b: int) -> float:
        held = prefix[b] - prefix[a] + (first_bytes if k == 0 else 0.0) + (last_bytes if k == n - 1 else 0.0)
        return held / usable[k] if usable[k] > 0 else math.inf

    best: dict[tuple[int, int], tuple[float, int]] = {}  # (device, start) -> (max fill, end)
    for k in reversed(range(n)):
        for a in range(k, num_layers - (n - 1 - k)):
            ends = [num_layers] if k == n - 1 else range(a + 1, num_layers - (n - 2 - k))
            options = [
                (max(fill(k, a, b), best[k + 1, b][0] if k < n - 1 else 0.0), b)
                for b in ends
                if k == n - 1 or (k + 1, b) in best
            ]
            if options:
                best[k, a] = min(options)
    if (0, 0) not in best or best[0, 0][0] > 1.0:
        return None
    split, a = [], 0
    for k in range(n):
        b = best[k, a][1]
        split.append((a, b))
        a = b
    return split


def survivor_plan(plan: PlanFile, lost: set[int], time_limit_s: float = PLAN_TIME_LIMIT_S) -> PlanFile:
    """`plan` without the stages `lost` (pipeline positions): the planner's plan on the survivors'
    devices (`planned_on_survivors`) when the plan's cluster and workload can be read, else the
    survivors' devices in their order with the layers split by memory (`split_by_memory`), links
    kept; raises `SurvivorsTooSmallError` when they cannot hold the model."""
    if plan.replicas and len(plan.replicas) > 1:
        raise TesselError("re-planning on the surviving stages of a replica plan is not supported")
    survivors = [s for s in plan.stages if s.index not in lost]
    names = ", ".join(f"stage {s.index} ({s.device})" for s in plan.stages if s.index in lost)
    if not survivors:
        raise SurvivorsTooSmallError(f"no stage is left after losing {names}")
    planned = planned_on_survivors(plan, survivors, names, time_limit_s)
    return planned if planned is not None else split_on_survivors(plan, survivors, names)


def planned_on_survivors(
    plan: PlanFile, survivors: list[PlanStage], names: str, time_limit_s: float
) -> PlanFile | None:
    """The planner (`tessel.plan.api.make_plan`) on the plan's cluster without the lost devices, under
    the plan's workload and settings; None when the cluster or the workload cannot be read back, or
    the plan chose weight precisions (the split by memory keeps those)."""
    source = plan.cluster.source or plan.cluster.name
    if plan.precisions or not (source in list_bundled_clusters() or Path(source).is_file()):
        return None
    try:
        cluster = load_cluster(source)
        fields = {key: value for key, value in plan.workload.items() if key in Workload.model_fields}
        workload = parse_workload(fields, source=f"{plan.source} workload")
        keep = {gpu for s in survivors for gpu in s.rank_gpus}  # every rank of a tensor-parallel stage
        for device in keep:
            cluster.device(device)  # a plan made for another cluster: fall back
    except TesselError:
        return None
    nodes = tuple(
        replace(node, device_names=tuple(d for d in node.device_names if d in keep))
        for node in cluster.nodes
        if any(d in keep for d in node.device_names)
    )
    devices = tuple(d for d in cluster.devices if d.name in keep)
    without = replace(cluster, nodes=nodes, devices=devices)
    settings = PlanSettings.of_plan(plan, time_limit_s=time_limit_s)
    try:
        outcome = make_plan(plan.model_spec, without, workload, settings)
    except TesselError as error:
        raise SurvivorsTooSmallError(
            f"the stages left after losing {names} cannot hold the model: {error}"
        ) from None
    if outcome.result.evaluation is None:
        raise SurvivorsTooSmallError(f"the planner found no plan on the stages left after losing {names}")
    return replace(outcome, cluster_source=source).plan_file()  # the next loss reads the same cluster


def split_on_survivors(plan: PlanFile, survivors: list[PlanStage], names: str) -> PlanFile:
    """The survivors in their order, the layers split by their memory (`split_by_memory`)."""
    spec = plan.model_spec
    layer_bytes = _layer_bytes(spec, plan)
    usable = [device_usable_bytes(plan, s) for s in survivors]
    first = float(embedding_bytes(spec, plan.dtype))
    last = float(lm_head_bytes(spec, plan.dtype, on_first_stage=len(survivors) == 1))
    split = split_by_memory(layer_bytes, usable, first, last)
    if split is None:
        need = sum(layer_bytes) + first + last
        raise SurvivorsTooSmallError(
            f"the stages left after losing {names} cannot hold the model: "
            f"{len(survivors)} device(s) offer {sum(usable) / 2**30:.2f} GiB "
            f"({', '.join(f'{s.device} {u / 2**30:.2f}' for s, u in zip(survivors, usable, strict=True))}), "
            f"its {spec.num_layers} layers, embedding and head need {need / 2**30:.2f} GiB"
        )
    return _with_stages(plan, survivors, split)


def _with_stages(plan: PlanFile, survivors: list[PlanStage], split: list[tuple[int, int]]) -> PlanFile:
    per_layer = plan.units_per_layer
    unit_precision = None
    if any(s.precisions for s in plan.stages):
        unit_precision = [plan.dtype] * (plan.num_layers * per_layer)
        for stage in plan.stages:
            unit_precision[stage.unit_start : stage.unit_end] = stage.unit_precisions(plan.dtype)
    stages = []
    for position, (stage, (a, b)) in enumerate(zip(survivors, split, strict=True)):
        last = position == len(survivors) - 1
        units = (a * per_layer, b * per_layer)
        stages.append(
            stage.model_copy(
                update={
                    "index": position,
                    "layer_start": a,
                    "layer_end": b,
                    "unit_start": units[0],
                    "unit_end": units[1],
                    "weights_gib": None,
                    "kv_gib": None,
                    "offload_gib": 0.0,
                    "prefill_ms": None,
                    "decode_ms": None,
                    "link_to_next": None if last else stage.link_to_next,
                    "precisions": None if unit_precision is None else unit_precision[units[0] : units[1]],
                }
            )
        )
    return plan.model_copy(
        update={"stages": stages, "replicas": [], "baselines": {}, "predicted": None, "objective": None}
    )


def write_survivor_plan(plan: PlanFile, lost: set[int], out: Path) -> Path:
    """`survivor_plan` written next to the run's files (`out`); -> its path."""
    survivor = survivor_plan(plan, lost)
    survivor.write(out)
    return out
