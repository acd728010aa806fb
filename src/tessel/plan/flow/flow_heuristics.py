"""Cheap flow-plan candidates beside the flow MILP (`tessel.plan.flow.flow_milp.solve_flow`); the search
over both is `tessel.plan.flow.flow_choice.search_flow`.

- `separate_chains`: each GPU type's devices in same-type pipelines of one size with even layer
  splits (Helix's separate-pipelines baseline, `tessel.plan.replicas.replica_baseline`, by memory), the size
  with the most throughput per type; disjoint paths, so priced as those pipelines are.
- `per_type_best`: per GPU type, the better of its separate chains and the Swarm-like plan of that
  type's devices alone (`tessel.plan.flow.swarm`), the types' plans then served side by side.
- `swarm_placements_flow_routed`: Swarm-like placements routed by max flow (compute, or compute and
  memory by Little's law) instead of greedily.
- `tuned_placement`: Petals' placement rule with a KV fraction per GPU type (Swarm-like uses one for
  all), tuned by coordinate descent, routed greedily; it starts from the Swarm-like plan's fractions,
  so it never serves less.

All are flow plans of `tessel.plan.flow.flow`, so the search returns the best of them and the MILP's:
never less than the separate-pipelines baseline or the Swarm-like plan.
"""

from __future__ import annotations

import time

from tessel.errors import TesselError
from tessel.plan.flow.flow import (
    FlowPlan,
    fixed_bytes,
    flow_instance,
    from_pipelines,
    price_paths,
    route_placements,
)
from tessel.plan.flow.flow_milp import LIFETIME_FACTORS, natural_lifetime_s
from tessel.plan.flow.swarm import PLACEMENT_FRACTIONS, greedy_routed, petals_placement, swarm_like
from tessel.plan.instance import PlanningInstance, gpu_memory_only, subset, with_micro_batches
from tessel.plan.replicas.replicas import holds_model
from tessel.plan.solution import Solution, Stage
from tessel.plan.solvers.baselines import uniform


def by_type(instance: PlanningInstance) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for j, d in enumerate(instance.devices):
        out.setdefault(d.gpu_type, []).append(j)
    for members in out.values():
        members.sort(key=lambda j: (instance.devices[j].node, instance.devices[j].name))
    return out


def _uniform_pipeline(one: PlanningInstance, group: tuple[int, ...]) -> Solution | None:
    result = uniform(subset(one, group))
    if result.solution is None:
        return None
    return Solution(tuple(Stage(group[s.device], s.unit_start, s.unit_end) for s in result.solution.stages))


def separate_chains(
    instance: PlanningInstance, micro_batch_size: int, members: list[int], cap: int | None = None
) -> FlowPlan | None:
    """The best same-type even-split pipelines of `members` (one size for all), by memory."""
    one = gpu_memory_only(with_micro_batches(instance, 1))
    best = None
    for size in range(1, len(members) + 1):
        groups = [tuple(members[i : i + size]) for i in range(0, len(members) - size + 1, size)]
        if not holds_model(one, groups[0], gpu_only=True):
            continue
        pipelines = [p for g in groups if (p := _uniform_pipeline(one, g)) is not None]
        plan = from_pipelines(instance, pipelines, micro_batch_size, cap) if pipelines else None
        if plan is not None and (best is None or plan.throughput_tok_s > best.throughput_tok_s):
            best = plan
    return best


def _local_to_global(
    plan: FlowPlan, devices: list[int]
) -> tuple[list[Stage], list[tuple[tuple[int, ...], int]]]:
    stages = [Stage(devices[s.device], s.unit_start, s.unit_end) for s in plan.stages]
    paths = [(tuple(devices[d] for d in p.devices), p.micro_batches) for p in plan.paths]
    return stages, paths


def per_type_best(instance: PlanningInstance, micro_batch_size: int) -> FlowPlan | None:
    """Per GPU type the better of separate chains and its own Swarm-like plan, served together."""
    stages: list[Stage] = []
    paths: list[tuple[tuple[int, ...], int]] = []
    for members in by_type(instance).values():
        chains = separate_chains(instance, micro_batch_size, members)
        swarm = swarm_like(subset(instance, tuple(members)), micro_batch_size)
        options = []
        if chains is not None:
            options.append(
                (
                    chains.throughput_tok_s,
                    [*chains.stages],
                    [(p.devices, p.micro_batches) for p in chains.paths],
                )
            )
        if swarm is not None:
            options.append((swarm.throughput_tok_s, *_local_to_global(swarm, members)))
        if options:
            _, s, p = max(options, key=lambda o: o[0])
            stages += s
            paths += p
    if not paths:
        return None
    return price_paths(instance, stages, paths, micro_batch_size)


def flow_routed(
    instance: PlanningInstance,
    stages: list[Stage],
    micro_batch_size: int,
    cap: int | None = None,
    lifetime_s: float = 0.0,
):
    """Placements routed by max flow instead of greedily (Helix over Swarm on one placement): each
    device's capacity is one micro-batch per its time on its range and, with `lifetime_s`, at most
    the micro-batches its free memory holds per `lifetime_s` (Little's law); the max flow is
    decomposed into paths and priced (`tessel.plan.flow.flow.route_placements`). None when no path
    reaches the last unit or a device cannot hold its range."""
    one = flow_instance(instance)
    n_out = one.decode_weight / one.prefill_weight
    work = one.prefill.unit_time_s + n_out * one.decode.unit_time_s
    rates = {}
    for s in stages:
        rate = 1.0 / float(work[s.unit_start : s.unit_end, s.device].sum())
        fixed, kv = fixed_bytes(one, s)
        free = one.devices[s.device].memory_bytes - fixed
        if free < 0:
            return None
        if lifetime_s > 0 and kv > 0:
            rate = min(rate, free / (kv * lifetime_s))
        rates[s.device] = rate
    try:
        return route_placements(instance, stages, rates, micro_batch_size, cap)
    except TesselError:
        return None


def swarm_placements_flow_routed(
    instance: PlanningInstance, micro_batch_size: int, cap: int | None = None
) -> FlowPlan | None:
    """Swarm-like placements (`tessel.plan.flow.swarm`) at several KV fractions, each routed by max flow
    with capacities by compute alone and by compute and memory (`LIFETIME_FACTORS` of the natural
    lifetime, `tessel.plan.flow.flow_milp.natural_lifetime_s`)."""
    one = flow_instance(instance)
    natural = natural_lifetime_s(instance, tuple((j,) for j in range(instance.n_devices)))
    best = None
    for fraction in PLACEMENT_FRACTIONS:
        stages = petals_placement(one, fraction)
        if not stages:
            continue
        for factor in (0.0, *LIFETIME_FACTORS):
            plan = flow_routed(instance, stages, micro_batch_size, cap, natural * factor)
            if plan is not None and (best is None or plan.throughput_tok_s > best.throughput_tok_s):
                best = plan
    return best


def tuned_placement(
    instance: PlanningInstance, micro_batch_size: int, deadline: float, cap: int | None = None
) -> FlowPlan | None:
    """Swarm-like placements with a KV fraction per GPU type instead of one for all, tuned by
    coordinate descent (each type's fraction over `PLACEMENT_FRACTIONS` in turn, kept when the plan,
    routed greedily and priced as flow plans are, serves more) until no change or `deadline`
    (`time.perf_counter()` seconds). Starts from the best single fraction."""
    one = flow_instance(instance)
    types = sorted({d.gpu_type for d in instance.devices})

    def value(fractions: dict[str, float]):
        stages = petals_placement(one, fractions)
        return greedy_routed(instance, stages, micro_batch_size, cap) if stages else None

    best, best_fractions = None, None
    for f in PLACEMENT_FRACTIONS:
        fractions = dict.fromkeys(types, f)
        plan = value(fractions)
        if plan is not None and (best is None or plan.throughput_tok_s > best.throughput_tok_s):
            best, best_fractions = plan, fractions
        if time.perf_counter() > deadline:
            return best
    if best is None:
        return None
    improved = True
    while improved:
        improved = False
        for t in types:
            for f in PLACEMENT_FRACTIONS:
                if f == best_fractions[t]:
                    continue
                if time.perf_counter() > deadline:
                    return best
                trial = {**best_fractions, t: f}
                plan = value(trial)
                if plan is not None and plan.throughput_tok_s > best.throughput_tok_s * (1 + 1e-9):
                    best, best_fractions, improved = plan, trial, True
    return best
