"""Helix's baseline for replicas: separate pipelines of one GPU type each, layers split uniformly.

Helix (Mei et al., 2025) compares its max-flow placement with "separate pipelines": each GPU type
serves on its own, in pipelines of the fewest GPUs of that type that hold the model, with the
layers split evenly (vLLM's default). This builds that baseline in tessel's cost model so that
`--replicas` can be compared with Helix's published ratio on the same footing:

- per type, groups of the smallest size that holds weights + KV in GPU memory (host memory when
  no group of the type can); the type's devices left over stay idle;
- each group runs `tessel.plan.solvers.baselines.uniform` (even layer counts over its devices);
- the groups share the workload's m micro-batches exactly as replicas do (`allocate`).

With `concurrency="memory"` (offline work, as Helix's offline setting): no host memory, each group
carries as many micro-batches as its uniform split's stages hold (`memory_micro_batches`, at most
`max_micro_batches` in all), and every group size of a type from the smallest that holds the model
to all its GPUs is tried, the best size kept per type (the strongest form of the baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.plan.instance import PlanningInstance, gpu_memory_only, share, subset, with_micro_batches
from tessel.plan.replicas.replicas import allocate, memory_micro_batches, smallest_group
from tessel.plan.report import predict
from tessel.plan.solvers.baselines import uniform


@dataclass(frozen=True, slots=True)
class SeparateUniform:
    throughput_tok_s: float
    groups: tuple[tuple[str, int, int], ...]  # (GPU type, GPUs in the group, micro-batches it serves)


def separate_uniform(
    instance: PlanningInstance,
    micro_batch_size: int,
    concurrency: str = "fixed",
    max_micro_batches: int | None = None,
) -> SeparateUniform | None:
    """The best allocation of the workload's micro-batches over same-type uniform pipelines; None
    when no GPU type can hold the model on its own."""
    if concurrency == "memory":
        return _separate_by_memory(instance, micro_batch_size, max_micro_batches)
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


def _separate_by_memory(
    instance: PlanningInstance, micro_batch_size: int, max_micro_batches: int | None
) -> SeparateUniform | None:
    base = gpu_memory_only(instance)
    cap = max_micro_batches
    by_type: dict[str, list[int]] = {}
    for j, device in enumerate(base.devices):
        by_type.setdefault(device.gpu_type, []).append(j)
    curves, labels = [], []
    for gpu_type, members in by_type.items():
        members.sort(key=lambda j: (base.devices[j].node, base.devices[j].name))
        smallest = smallest_group(with_micro_batches(base, 1), members)[True]
        if smallest is None:
            continue
        best: tuple[float, list[dict[int, float]], int] | None = None
        for size in range(smallest, len(members) + 1):
            groups = [tuple(members[i : i + size]) for i in range(0, len(members) - size + 1, size)]
            type_curves = [_memory_curve(subset(base, g), micro_batch_size, cap) for g in groups]
            total = sum(max(c.values(), default=0.0) for c in type_curves)
            if best is None or total > best[0]:
                best = (total, type_curves, size)
        if best is not None and best[0] > 0:
            curves += best[1]
            labels += [(gpu_type, best[2])] * len(best[1])
    if cap is None:
        shares = [max(c, key=c.get) if c else 0 for c in curves]
        total = sum(c[k] for c, k in zip(curves, shares, strict=True) if k > 0)
        if total <= 0:
            return None
    else:
        found = allocate(curves, cap)
        if found is None:
            return None
        total, shares = found
    served = tuple((t, size, k) for (t, size), k in zip(labels, shares, strict=True) if k > 0)
    return SeparateUniform(total, served)


def _memory_curve(group: PlanningInstance, micro_batch_size: int, cap: int | None) -> dict[int, float]:
    """Throughput of the group's uniform split at each k up to what its stages hold."""
    one = with_micro_batches(group, 1)
    result = uniform(one)
    if not result.feasible:
        return {}
    most = memory_micro_batches(one, result.evaluation)
    most = int(min(most, cap if cap is not None else most, 10**6))
    curve = {}
    for k in range(1, most + 1) if cap is not None else (most,):
        part = with_micro_batches(group, k)
        curve[k] = predict(part, uniform(part).evaluation, micro_batch_size).throughput_tok_s
    return curve
