"""Helix's baseline for replicas: separate pipelines of one GPU type each, layers split uniformly.

Helix (Mei et al., 2025) compares its max-flow placement with "separate pipelines": each GPU type
serves on its own, in pipelines of the fewest GPUs of that type that hold the model, with the
layers split evenly (vLLM's default). This builds that baseline in tessel's cost model so that
`--replicas` can be compared with Helix's published ratio on the same footing:

- per type, groups of the smallest size that holds weights + KV in GPU memory (host memory when
  no group of the type can); the type's devices left over stay idle;
- each group runs `tessel.plan.baselines.uniform` (even layer counts over its devices);
- the groups share the workload's m micro-batches exactly as replicas do (`allocate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.plan.baselines import uniform
from tessel.plan.instance import PlanningInstance
from tessel.plan.replicas import allocate, share, smallest_group, subset
from tessel.plan.report import predict


@dataclass(frozen=True, slots=True)
class SeparateUniform:
    throughput_tok_s: float
    groups: tuple[tuple[str, int, int], ...]  # (GPU type, GPUs in the group, micro-batches it serves)


def separate_uniform(instance: PlanningInstance, micro_batch_size: int) -> SeparateUniform | None:
    """The best allocation of the workload's micro-batches over same-type uniform pipelines; None
    when no GPU type can hold the model on its own."""
    groups = _same_type_groups(instance)
    curves = [_curve(subset(instance, g), micro_batch_size) for g in groups]
    found = allocate(curves, instance.micro_batches)
    if found is None:
        return None
    total, shares = found
    served = tuple(
        (instance.devices[g[0]].gpu_type, len(g), k) for g, k in zip(groups, shares, strict=True) if k > 0
    )
    return SeparateUniform(total, served)


def _same_type_groups(instance: PlanningInstance) -> list[tuple[int, ...]]:
    by_type: dict[str, list[int]] = {}
    for j, device in enumerate(instance.devices):
        by_type.setdefault(device.gpu_type, []).append(j)
    groups = []
    for members in by_type.values():
        members.sort(key=lambda j: (instance.devices[j].node, instance.devices[j].name))
        smallest = smallest_group(instance, members)
        size = smallest[True] or smallest[False]
        if size is not None:
            groups += [tuple(members[i : i + size]) for i in range(0, len(members) - size + 1, size)]
    return groups


def _curve(group: PlanningInstance, micro_batch_size: int) -> dict[int, float]:
    """Throughput of the group's uniform pipeline at each share k (k missing: it cannot serve k)."""
    curve = {}
    for k in range(1, group.micro_batches + 1):
        part = share(group, k)
        result = uniform(part)
        if result.feasible:
            curve[k] = predict(part, result.evaluation, micro_batch_size).throughput_tok_s
    return curve
