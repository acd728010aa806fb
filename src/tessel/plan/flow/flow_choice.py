"""`tessel plan --replicas auto` with concurrency by memory: single pipelines, disjoint replicas and
flow plans compared, the best returned (never worse than any of them).

`choose_with_flow` runs the flow search (`search_flow`: the cheap candidates of
`tessel.plan.flow.flow_heuristics`, then the flow MILP of `tessel.plan.flow.flow_milp` seeded by them) on
`FLOW_SHARE` of the time limit, then the replica search (`tessel.plan.replicas.replicas.choose_replicas`,
which keeps the whole cluster as one pipeline and the fixed shares as candidates) on the rest
(`FLOW_SHARE_LARGE` for the flow search on clusters beyond `EXHAUSTIVE_DEVICES`, where the replica
search only screens candidate splits). The replica plan is itself a flow plan of the same throughput
(disjoint paths are priced as replicas are), so the flow plan is taken only when it serves strictly
more.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from tessel.plan.flow.flow import FlowPlan
from tessel.plan.flow.flow_heuristics import per_type_best, swarm_placements_flow_routed, tuned_placement
from tessel.plan.flow.flow_milp import FlowSearch, solve_flow
from tessel.plan.flow.swarm import swarm_like
from tessel.plan.instance import PlanningInstance
from tessel.plan.replicas.replicas import EXHAUSTIVE_DEVICES, ReplicaPlan, ReplicaSettings, choose_replicas
from tessel.plan.solution import Stage

FLOW_SHARE = 0.5  # of the time limit for the flow search, run first; the replica search gets the rest
FLOW_SHARE_LARGE = 0.7  # beyond EXHAUSTIVE_DEVICES (the replica search then screens candidate splits)
MIN_FLOW_S = 2.0
# of the time left after the flow search, kept back from the replica search: its solves may run past
# their shares (a HiGHS or DP pass ends after its limit), so the whole call ends within the limit
REPLICA_RESERVE = 0.4
KINDS = ("single", "replicas", "flow")
TUNED_SHARE = 0.6  # of the flow search's time: the cheap candidates and the tuned placement end there


@dataclass(frozen=True, slots=True)
class FlowChoice:
    replicas: ReplicaPlan
    search: FlowSearch | None  # None: not run (fixed concurrency, a replica count, no time)
    time_s: float

    @property
    def flow(self) -> FlowPlan | None:
        """The flow plan when it serves more than the replicas, else None."""
        plan = None if self.search is None else self.search.plan
        if plan is None or plan.throughput_tok_s <= self.replicas.throughput_tok_s * (1 + 1e-9):
            return None
        return plan

    @property
    def kind(self) -> str:
        if self.flow is not None:
            return "flow"
        return "single" if len(self.replicas.replicas) == 1 else "replicas"

    @property
    def throughput_tok_s(self) -> float:
        flow = self.flow
        return self.replicas.throughput_tok_s if flow is None else flow.throughput_tok_s

    @property
    def bound_tok_s(self) -> float:
        """The memory + requests-in-flight bound (`tessel.plan.solvers.memory_bound`): no flow plan, replica
        split or pipeline served by memory exceeds it (inf: none)."""
        return self.replicas.split_bound_tok_s if self.replicas.concurrency == "memory" else math.inf

    @property
    def gap(self) -> float | None:
        bound = self.bound_tok_s
        if not math.isfinite(bound) or bound <= 0:
            return None
        return max(bound - self.throughput_tok_s, 0.0) / bound

    @property
    def pipelines_bound_tok_s(self) -> float:
        """The memory bound with the pipeline fill counted: no set of disjoint pipelines served by
        memory exceeds it (inf: none). A flow plan whose paths share a device may."""
        if self.replicas.concurrency != "memory":
            return math.inf
        return self.replicas.pipelines_bound_tok_s

    @property
    def disjoint(self) -> bool:
        """Whether the chosen plan's pipelines share no device."""
        flow = self.flow
        return flow is None or not flow.shared

    @property
    def offloads(self) -> bool:
        """Whether the chosen plan holds weights or KV in host memory (the whole cluster as one
        pipeline at the workload's m may; the bounds by memory do not cover it)."""
        if self.flow is not None:
            return False
        return any(r.result.evaluation.offload_bytes > 0 for r in self.replicas.replicas)


def search_flow(
    instance: PlanningInstance,
    micro_batch_size: int,
    *,
    time_limit_s: float = 30.0,
    max_micro_batches: int | None = None,
) -> FlowSearch:
    """The best flow plan of the cheap candidates (`tessel.plan.flow.flow_heuristics`: separate chains per
    type, the better of those and a Swarm-like plan per type; the Swarm-like plan of all devices;
    Swarm-like placements routed by max flow; placements with a KV fraction per type tuned by
    coordinate descent, until `TUNED_SHARE` of the time),
    used as warm starts, and of the flow MILP (`solve_flow`) on the time left."""
    started = time.perf_counter()
    deadline = started + TUNED_SHARE * time_limit_s
    candidates = {
        "swarm-like": swarm_like(instance, micro_batch_size, max_micro_batches),
        "tuned-placement": tuned_placement(instance, micro_batch_size, deadline, max_micro_batches),
    }
    if max_micro_batches is None:  # per-type plans are not capped in all
        candidates["per-type"] = per_type_best(instance, micro_batch_size)
    if time.perf_counter() < deadline:
        routed = swarm_placements_flow_routed(instance, micro_batch_size, max_micro_batches)
        candidates["swarm-placement-flow"] = routed
    seeds = [list(plan.stages) for plan in candidates.values() if plan is not None]
    left = time_limit_s - (time.perf_counter() - started)
    found = solve_flow(
        instance, micro_batch_size, time_limit_s=left, max_micro_batches=max_micro_batches, seeds=seeds
    )
    best, source = found.plan, "milp"
    for name, plan in candidates.items():
        if plan is not None and (best is None or plan.throughput_tok_s > best.throughput_tok_s):
            best, source = plan, name
    return FlowSearch(best, found.milps, time.perf_counter() - started, source)


def choose_with_flow(
    instance: PlanningInstance, micro_batch_size: int, settings: ReplicaSettings = ReplicaSettings()
) -> FlowChoice:
    """The best of one pipeline, disjoint replicas and (with `settings.replicas` None, concurrency by
    memory and no precision choice) flow plans."""
    started = time.perf_counter()
    time_limit_s, max_micro_batches = settings.time_limit_s, settings.max_micro_batches
    # flow plans are priced at one precision per unit as given: with a precision choice, not searched
    flow = settings.replicas is None and settings.concurrency == "memory" and instance.precision is None
    search = None
    share = FLOW_SHARE if instance.n_devices <= EXHAUSTIVE_DEVICES else FLOW_SHARE_LARGE
    if flow and time_limit_s * share >= MIN_FLOW_S:
        search = search_flow(
            instance,
            micro_batch_size,
            time_limit_s=share * time_limit_s,
            max_micro_batches=max_micro_batches,
        )
    left = time_limit_s - (time.perf_counter() - started)
    if search is not None:
        left *= 1 - REPLICA_RESERVE
    chosen = choose_replicas(
        instance, micro_batch_size, replace(settings, time_limit_s=max(left, MIN_FLOW_S))
    )
    return FlowChoice(chosen, search, time.perf_counter() - started)


def replica_stages(plan: ReplicaPlan) -> list[Stage]:
    """The replicas' stages with the cluster's device indices."""
    out = []
    for replica in plan.replicas:
        for s in replica.result.solution.stages:
            out.append(Stage(replica.devices[s.device], s.unit_start, s.unit_end))
    return out
