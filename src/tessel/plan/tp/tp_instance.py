"""The planning problem over tensor-parallel groups: each group of a grouping is one device.

A group of degree d (d GPUs of one type on one machine) becomes one `DeviceSlot` whose numbers
make the solvers' per-device rules hold per GPU:

- times: what one rank takes for the sharded model (`tessel.cost.tensor_parallel.shard_model`) plus
  the unit's all-reduces over the group's ring (the embedding adds one all-reduce, the LM head an
  all-gather of the logits);
- memory: held / d <= each rank's memory is held <= d x a rank's memory, with weights, KV (split by
  KV heads), embedding and LM head (split by vocab rows) counted whole, as the instance holds them,
  and d workspaces of the sharded model (each rank runs its own activations);
- host memory and the host links: the ranks' sums (each rank streams its own shard over its own
  PCIe); evicted KV: swapped by every rank at once, recomputed by the group;
- links to other stages: rank 0's (hidden states go from one rank to the next stage's rank 0).

Degree-1 groups keep the base instance's numbers unchanged, so the grouping of every GPU alone is
exactly the pipeline-only problem.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tessel.catalog.models import ModelSpec
from tessel.cost import layer as L
from tessel.cost.link import LinkSpec
from tessel.cost.profile import Profile
from tessel.cost.roofline import select_profile, unit_prefill_time_s
from tessel.cost.tensor_parallel import TensorParallel, shard_model
from tessel.plan.build import PassShape, TypeCosts
from tessel.plan.files.cluster import Cluster
from tessel.plan.files.workload import Workload
from tessel.plan.instance import DeviceSlot, KvRestore, PassCosts, PlanningInstance
from tessel.plan.tp.groups import Grouping


@dataclass(frozen=True, slots=True)
class TpContext:
    """What pricing a group needs beyond the base (degree-1) instance."""

    model: ModelSpec
    cluster: Cluster
    workload: Workload
    dtype: str = "fp16"
    kv_dtype: str = "fp16"
    profiles: tuple[Profile, ...] = ()


def ring_link(cluster: Cluster, gpus: Sequence[str]) -> LinkSpec:
    """The slowest link of the ring over `gpus` (the least bandwidth, the most latency)."""
    links = [cluster.link(a, gpus[(i + 1) % len(gpus)]) for i, a in enumerate(gpus)]
    return LinkSpec(min(x.bandwidth_bytes_per_s for x in links), max(x.latency_s for x in links))


def tensor_parallel(cluster: Cluster, gpus: Sequence[str]) -> TensorParallel:
    return TensorParallel(len(gpus), ring_link(cluster, gpus) if len(gpus) > 1 else LinkSpec(1.0, 0.0))


@dataclass(frozen=True, slots=True)
class _GroupCosts:
    prefill: np.ndarray  # [kinds]
    decode: np.ndarray
    first: tuple[float, float]  # prefill, decode
    last: tuple[float, float]
    workspace_bytes: float
    recompute_s_per_byte: float


def _group_costs(ctx: TpContext, base: PlanningInstance, gpus: tuple[str, ...]) -> _GroupCosts:
    model, d = ctx.model, len(gpus)
    spec = ctx.cluster.device(gpus[0]).spec
    tp = tensor_parallel(ctx.cluster, gpus)
    shard = shard_model(model, d)
    kinds = tuple(dict.fromkeys(unit.kind for unit in base.units))
    shape = PassShape.of(ctx.workload)
    costs = TypeCosts.of(shard, spec, kinds, shape, ctx.dtype, ctx.kv_dtype, ctx.profiles)
    act = L.activation_dtype(ctx.dtype)
    b = shape.batch

    def comm(kind: str, tokens: float) -> float:
        return tp.unit_comm_s(model, kind, tokens, act)

    prefill = np.array(
        [t + comm(k, shape.prefill_tokens) for t, k in zip(costs.prefill_s, kinds, strict=True)]
    )
    decode = np.array([t + comm(k, b) for t, k in zip(costs.decode_s, kinds, strict=True)])
    context = max(round(shape.decode_context), 1)
    profile = select_profile(ctx.profiles, shard, spec, ctx.dtype)
    recompute_s = unit_prefill_time_s(
        shard,
        spec,
        "layer",
        context,
        0,
        batch_size=b,
        dtype=ctx.dtype,
        kv_dtype=ctx.kv_dtype,
        profile=profile,
    ) + comm("layer", context * b)
    return _GroupCosts(
        prefill=prefill,
        decode=decode,
        first=(
            costs.embed_prefill_s + tp.embed_comm_s(model, shape.prefill_tokens, act),
            costs.embed_decode_s + tp.embed_comm_s(model, b, act),
        ),
        last=(
            costs.head_prefill_s + tp.logits_comm_s(shard, b, act),
            costs.head_decode_s + tp.logits_comm_s(shard, b, act),
        ),
        workspace_bytes=d * float(L.workspace_bytes(shard, shape.max_prefill_tokens, act)),
        recompute_s_per_byte=recompute_s / (L.kv_bytes_per_token(model, ctx.kv_dtype) * context * b),
    )


def tp_instance(
    base: PlanningInstance, ctx: TpContext, grouping: Grouping, cache: dict | None = None
) -> PlanningInstance:
    """The planning problem whose devices are the groups of `grouping` (module docstring); `cache`
    keeps group prices across groupings."""
    if base.precision is not None and any(len(g) > 1 for g in grouping):
        raise ValueError("tensor-parallel groups are priced at one weight precision")
    index = {slot.name: j for j, slot in enumerate(base.devices)}
    heads = [index[g[0]] for g in grouping]
    kinds = tuple(dict.fromkeys(unit.kind for unit in base.units))
    kind_of = np.array([kinds.index(unit.kind) for unit in base.units])
    cache = {} if cache is None else cache
    per_group = []
    for group in grouping:
        if len(group) == 1:
            per_group.append(None)
            continue
        slot = base.devices[index[group[0]]]
        key = (slot.gpu_type, slot.memory_bytes, len(group), ring_link(ctx.cluster, group))
        if key not in cache:
            cache[key] = _group_costs(ctx, base, group)
        per_group.append(cache[key])

    def pass_costs(costs: PassCosts, prefill: bool) -> PassCosts:
        unit = costs.unit_time_s[:, heads].copy()
        first, last = costs.first_time_s[heads].copy(), costs.last_time_s[heads].copy()
        for j, group in enumerate(per_group):
            if group is not None:
                unit[:, j] = (group.prefill if prefill else group.decode)[kind_of]
                first[j] = group.first[0 if prefill else 1]
                last[j] = group.last[0 if prefill else 1]
        return PassCosts(unit, first, last, costs.send_s[np.ix_(heads, heads)])

    workspace = np.asarray(base.workspace_bytes, dtype=float)[heads].copy()
    for j, group in enumerate(per_group):
        if group is not None:
            workspace[j] = group.workspace_bytes
    return replace(
        base,
        devices=tuple(_group_slot(base, [index[name] for name in g]) for g in grouping),
        prefill=pass_costs(base.prefill, True),
        decode=pass_costs(base.decode, False),
        workspace_bytes=workspace,
        kv_restore=_kv_restore(base, grouping, index, per_group),
    )


def _group_slot(base: PlanningInstance, members: list[int]) -> DeviceSlot:
    head = base.devices[members[0]]
    if len(members) == 1:
        return head
    slots = [base.devices[j] for j in members]
    return replace(
        head,
        memory_bytes=sum(s.memory_bytes for s in slots),
        host_bytes=sum(s.host_bytes for s in slots),
        host_to_device_bytes_per_s=sum(s.host_to_device_bytes_per_s for s in slots),
        device_to_host_bytes_per_s=sum(s.device_to_host_bytes_per_s for s in slots),
        tp_gpus=tuple(s.name for s in slots),
    )


def _kv_restore(base: PlanningInstance, grouping: Grouping, index: dict, per_group: list) -> KvRestore | None:
    if base.kv_restore is None:
        return None
    heads = [index[g[0]] for g in grouping]
    restore = base.kv_restore.subset(heads)
    swap, recompute = restore.swap_s_per_byte.copy(), restore.recompute_s_per_byte.copy()
    for j, (group, costs) in enumerate(zip(grouping, per_group, strict=True)):
        if costs is not None:
            swap[j] = swap[j] / len(group)  # every rank swaps its share at once
            recompute[j] = costs.recompute_s_per_byte
    return KvRestore(swap, recompute)
