"""A Swarm / Petals-like baseline for flow plans: greedy placement by coverage and greedy routing
by least load, priced in the same cost model as flow plans (`tessel.plan.flow.flow.price_paths`).

Placement (Petals' rule, on ranges that meet): devices join fastest first; each takes the most
layers its memory holds with a fraction `kv_fraction` of its free memory left for KV, starting at
the boundary (0 or where an earlier range ends) whose next layers have the least throughput
coverage (the sum over devices holding a layer of 1 / their time per micro-batch). Routing (Swarm's
rule): micro-batches are sent one at a time; each walks from layer 0 and at every boundary takes,
among the devices that start there, still reach the last layer and have memory for its KV, the one
whose busy time after taking it is least (its time per micro-batch breaks ties: fastest first),
until no micro-batch fits. The counts per path then go through the flow plans' pricing. Several
KV fractions are tried and the best kept (the strongest form of the baseline).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np

from tessel.plan.files.workload import MAX_MICRO_BATCHES
from tessel.plan.flow.flow import FlowPlan, fixed_bytes, flow_instance, price_paths
from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import FEASIBILITY_ATOL_BYTES, FEASIBILITY_RTOL, Stage

KV_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
PLACEMENT_FRACTIONS = KV_FRACTIONS  # the flow search routes these placements by max flow too


def swarm_like(
    instance: PlanningInstance, micro_batch_size: int, max_micro_batches: int | None = None
) -> FlowPlan | None:
    """The best Swarm-like plan over `KV_FRACTIONS` (None: no placement reaches the last layer)."""
    best = None
    for fraction in KV_FRACTIONS:
        plan = swarm_plan(instance, micro_batch_size, fraction, max_micro_batches)
        if plan is not None and (best is None or plan.throughput_tok_s > best.throughput_tok_s):
            best = plan
    return best


def swarm_plan(
    instance: PlanningInstance,
    micro_batch_size: int,
    kv_fraction: float,
    max_micro_batches: int | None = None,
) -> FlowPlan | None:
    stages = petals_placement(flow_instance(instance), kv_fraction)
    return greedy_routed(instance, stages, micro_batch_size, max_micro_batches) if stages else None


def greedy_routed(
    instance: PlanningInstance,
    stages: list[Stage],
    micro_batch_size: int,
    max_micro_batches: int | None = None,
) -> FlowPlan | None:
    """Placements routed as Swarm routes (the module docstring), priced as flow plans are."""
    one = flow_instance(instance)
    for s in stages:
        fixed, _ = fixed_bytes(one, s)
        if fixed > one.devices[s.device].memory_bytes * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_BYTES:
            return None
    counts = _route(one, stages, max_micro_batches)
    if not counts:
        return None
    return price_paths(instance, stages, list(counts.items()), micro_batch_size)


def _work(one: PlanningInstance) -> np.ndarray:
    n_out = one.decode_weight / one.prefill_weight
    return one.prefill.unit_time_s + n_out * one.decode.unit_time_s  # [U, N]


def petals_placement(one: PlanningInstance, kv_fraction: float | dict[str, float]) -> list[Stage]:
    """Petals' rule (the module docstring); `kv_fraction` one for all or one per GPU type."""
    n = one.n_units
    work = _work(one)
    order = sorted(range(one.n_devices), key=lambda j: float(work[:, j].sum()))
    coverage = np.zeros(n)
    boundaries, stages = {0}, []
    for j in order:
        memory = one.devices[j].memory_bytes - float(one.workspace_bytes[j])
        fraction = kv_fraction[one.devices[j].gpu_type] if isinstance(kv_fraction, dict) else kv_fraction
        options = []
        for start in sorted(boundaries):
            if start >= n:
                continue
            end = start
            while end < n:
                fixed, _ = fixed_bytes(one, Stage(j, start, end + 1))
                if fixed - float(one.workspace_bytes[j]) > (1 - fraction) * memory:
                    break
                end += 1
            if end > start:
                options.append((float(coverage[start:end].min()), start, end))
        if not options:
            continue
        _, start, end = min(options)
        stages.append(Stage(j, start, end))
        coverage[start:end] += 1.0 / float(work[start:end, j].sum())
        boundaries.add(end)
    return stages


def _route(one: PlanningInstance, stages: list[Stage], cap: int | None) -> Counter:
    n = one.n_units
    work = _work(one)
    by_start: dict[int, list[Stage]] = defaultdict(list)
    for s in stages:
        by_start[s.unit_start].append(s)
    reach = {n}  # boundaries from which the last layer is reachable
    for s in sorted(stages, key=lambda s: -s.unit_start):
        if s.unit_end in reach:
            reach.add(s.unit_start)
    room, kv, busy, per = {}, {}, defaultdict(float), {}
    for s in stages:
        fixed, kv[s.device] = fixed_bytes(one, s)
        memory = one.devices[s.device].memory_bytes * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_BYTES
        room[s.device] = memory - fixed
        per[s.device] = float(work[s.unit_start : s.unit_end, s.device].sum())
    counts: Counter = Counter()
    limit = math.inf if cap is None else cap
    total = 0
    while total < limit:
        path, at = [], 0
        while at < n:
            options = [
                s for s in by_start.get(at, ()) if s.unit_end in reach and room[s.device] >= kv[s.device]
            ]
            if not options:
                break
            s = min(options, key=lambda s: (busy[s.device] + per[s.device], per[s.device], s.device))
            path.append(s.device)
            at = s.unit_end
        if at < n or counts[tuple(path)] >= MAX_MICRO_BATCHES:
            break
        for d in path:
            room[d] -= kv[d]
            busy[d] += per[d]
        counts[tuple(path)] += 1
        total += 1
    return counts
