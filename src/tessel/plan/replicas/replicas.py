"""Several pipelines (replicas) on one cluster, and how requests are routed among them (Helix's idea).

`--replicas auto|N` splits the devices into disjoint groups; each group is planned as one pipeline
exactly as `tessel plan` plans a cluster (`solve` on the group's sub-instance), and idle devices are
allowed.

Shares of the in-flight requests: the workload keeps m micro-batches of b requests in flight (its
concurrency, m b) on the whole cluster, not on each replica. Replica r holds k_r of those
micro-batches (`share`: same b and pass costs, the KV of its own k_r micro-batches only, objective
with k_r micro-batches), with sum_r k_r <= m; a group with k_r = 0 is idle. The shares are chosen
exactly, by a knapsack over the integer grid k = 0..m (`allocate`), to maximise the summed throughput
X_r(k_r) = k_r b n_out / objective_r(k_r).

Routing is consistent with the shares by Little's law: the cluster is a closed system in which
replica r keeps its k_r b requests in flight, so it completes X_r requests-worth per second and each
of its requests stays k_r b / X_r (Little: in flight = rate x time in system). Routing in proportion
to completions, w_r = X_r / sum X (the max flow source -> replica r, capacity X_r -> sink, which
saturates every replica), is exactly the rate at which each replica frees a slot, so the routed
rate times the latency gives back each replica's share k_r b. The objective of a split is the summed
throughput (the max flow).

Which split (`choose_replicas`):
- N <= `EXHAUSTIVE_DEVICES` devices: every partition of the devices into groups (Bell(N) of them),
  each group planned once per share k = 1..m; with exact group plans this is the optimum over splits
  and shares (the tests hold it against brute force over partitions, shares and pipelines).
- larger clusters: on a cluster of several network islands (regions, `islands`), each island whole
  and each island's own type splits first; then candidates built from device types. For each type,
  the smallest group of that type that holds the model (weights, KV and extras within its GPU
  memory, else GPU + host) and twice that size; same-type groups first, the devices left over
  pooled by memory into mixed groups that hold the model; mixed splits where each of k in
  `SPREAD_REPLICAS` replicas gets a contiguous 1/k of every type's devices (by node); plus the
  whole cluster as one pipeline. Groups are planned once per signature (device types, how they
  share nodes, their islands) with an equal share of `SCREEN_TIME_SHARE` of the time limit each to
  rank the splits (a later group of the same signature re-uses the plan), at the largest share k
  <= m it holds; that placement is evaluated at every share k to allocate the shares; the best
  split's groups are then planned again at their shares with the time left.
  With a precision choice the screening plans a stand-in (`averaged_precisions`: the budget's
  precisions averaged over the units, fast) and the refinement plans the real choice.
  The split's own upper bound is the sum of each replica's throughput at its proven lower bound;
  `split_bound_tok_s` bounds every split there is (`tessel.plan.replicas.replica_bound`: the lesser of a fluid
  bound and a requests-in-flight bound, loose but proven), so `split_gap` is a proven gap to the best
  split at any cluster size.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from tessel.errors import TesselError
from tessel.plan.build import capacity_shortfall_bytes
from tessel.plan.files.workload import MAX_MICRO_BATCHES
from tessel.plan.instance import (
    PassCosts,
    PlanningInstance,
    gpu_memory_only,
    share,
    subset,
    with_micro_batches,
)
from tessel.plan.replicas.islands import island_of, network_islands
from tessel.plan.report import predict
from tessel.plan.solution import FEASIBILITY_ATOL_BYTES, FEASIBILITY_RTOL, evaluate
from tessel.plan.solvers.solve import PlanResult, solve

EXHAUSTIVE_DEVICES = 6  # Bell(6) = 203 partitions
MIN_REPLICA_TIME_S = 0.5
SCREEN_TIME_SHARE = 0.4  # of the time limit, split over the kinds of group, to rank the splits
SCREEN_STOP = 0.5  # a screening stops there, leaving the rest to plan the chosen split for real
REFINE_END = 0.9  # the refinement aims to end there: a group's solve may overrun its share a little
SPREAD_REPLICAS = (2, 4, 8)  # mixed splits tried: k replicas, each with a share of every type
# same-type splits tried: (GPU memory only, groups of this many times the smallest size that holds the model)
TYPE_SPLIT_VARIANTS = tuple((gpu_only, factor) for gpu_only in (True, False) for factor in (1, 2, 4))
CONCURRENCY_MODES = ("fixed", "memory")
SINGLE_TIME_SHARE = 0.3  # of the time limit: the whole cluster as one pipeline, planned first
MEMORY_TRIES = (1.0, 0.9, 0.75, 0.5)  # memory mode: fractions of a group's memory limit planned at
MEMORY_BOUND_S = 30.0  # HiGHS time for the memory bound's LP at most (never beyond the time limit)
MEMORY_SEARCH_SHARE = 0.6  # memory mode: its splits end there, the fixed shares get the rest
EVERY_K_UP_TO = 8  # memory mode, exhaustive search: every k up to this, then MEMORY_TRIES fractions


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    """How to split a cluster into replicas: the options of `tessel plan --replicas`, taken by
    `choose_replicas` and by `tessel.plan.flow.flow_choice.choose_with_flow`, which passes them on."""

    replicas: int | None = None  # how many pipelines (None: the best count)
    solver: str = "milp"  # each replica's pipeline: "milp", "dp" or "brute"
    time_limit_s: float = 30.0
    mip_gap: float = 0.01
    concurrency: str = "fixed"  # one of CONCURRENCY_MODES
    max_micro_batches: int | None = None  # with concurrency by memory: at most this many in flight


@dataclass(frozen=True, slots=True)
class Replica:
    devices: tuple[int, ...]  # indices into the cluster's devices
    instance: PlanningInstance  # the group's planning problem (device indices local to the group)
    result: PlanResult  # the group's pipeline
    throughput_tok_s: float
    upper_bound_tok_s: float  # throughput at the group's proven lower bound on the objective
    weight: float  # routing share (sums to 1 over the replicas)
    micro_batches: int = 1  # its share k of the workload's m micro-batches in flight (`instance` has k)

    def device_names(self) -> tuple[str, ...]:
        return tuple(self.instance.devices[s.device].name for s in self.result.solution.stages)


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    replicas: tuple[Replica, ...]
    throughput_tok_s: float  # max flow: the replicas' summed throughput
    upper_bound_tok_s: float  # for this split: the replicas' throughput at their lower bounds
    splits_evaluated: int
    exhaustive: bool  # every partition of the devices was tried
    time_s: float
    split_bound_tok_s: float = math.inf  # over every split of the devices (`replica_bound`)
    concurrency: str = "fixed"  # "fixed": shares of the workload's m; "memory": as memory holds
    single_tok_s: float = 0.0  # the whole cluster as one pipeline at the workload's m (a candidate)
    # concurrency by memory, over disjoint pipelines only (flow plans that share a device may pass
    # it): the lesser of the memory bound with the pipeline fill counted and the compositions bound
    pipelines_bound_tok_s: float = math.inf


def routing_weights(capacities: list[float]) -> list[float]:
    """Max flow source -> replica r (capacity c_r) -> sink: each replica's share c_r / sum c."""
    total = float(sum(capacities))
    if total <= 0:
        raise ValueError("no replica has capacity")
    return [c / total for c in capacities]


def memory_micro_batches(instance: PlanningInstance, evaluation) -> float:
    """The most micro-batches a plan's stages hold in device memory (weights, extras and workspace
    fixed, KV growing with the count): min over stages of free memory / KV of one micro-batch
    (inf when no stage holds KV); < 1 when it does not even hold one."""
    m = instance.micro_batches
    most = math.inf
    for stage in evaluation.stages:
        per = stage.kv_bytes / m
        if per <= 0:
            continue
        memory = instance.devices[stage.stage.device].memory_bytes
        free = memory * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_BYTES - (stage.held_bytes - stage.kv_bytes)
        most = min(most, free / per)
    return most


def group_memory_limit(instance: PlanningInstance, devices: tuple[int, ...], cap: int) -> int:
    """The most micro-batches (<= cap) whose KV, with the weights and extras, fits the group's GPU
    memory in all (`holds_model`, GPU only): no plan of the group holds more; 0 when not even one."""
    if not holds_model(with_micro_batches(instance, 1), devices, gpu_only=True):
        return 0
    low, high = 1, cap
    while low < high:  # largest k that holds
        middle = (low + high + 1) // 2
        if holds_model(with_micro_batches(instance, middle), devices, gpu_only=True):
            low = middle
        else:
            high = middle - 1
    return low


def allocate(curves: list[dict[int, float]], budget: int, count: int | None = None):
    """Shares k_g (0 = idle) of `budget` micro-batches for groups with throughput curves
    {k: X_g(k)} (k missing: the group cannot serve k), maximising sum X_g(k_g) with sum k_g <= budget
    (exact knapsack over the integer grid). With `count`, exactly that many groups get a share.
    Returns (total, shares) or None when no allocation is possible."""
    states: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {(0, 0): (0.0, ())}
    for curve in curves:
        nxt: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}
        for (used, served), (value, ks) in states.items():
            options = [(0, 0.0), *((k, x) for k, x in curve.items() if used + k <= budget)]
            for k, x in options:
                key = (used + k, served + (k > 0))
                if key not in nxt or value + x > nxt[key][0] * (1 + 1e-12):
                    nxt[key] = (value + x, (*ks, k))
        states = nxt
    found = [v for (_, served), v in states.items() if served > 0 and (count is None or served == count)]
    return max(found, key=lambda v: v[0]) if found else None


def holds_model(instance: PlanningInstance, devices: tuple[int, ...], gpu_only: bool = False) -> bool:
    """Whether a group has the memory for the model at its fewest bytes (weights + KV + extras)."""
    sub = subset(instance, devices)
    sub = sub.relaxed()
    if not gpu_only:
        return capacity_shortfall_bytes(sub) <= 0
    held = float(np.sum(sub.weight_bytes) + np.sum(sub.kv_bytes)) + sub.first_bytes + sub.last_bytes
    held += float(np.sum(sub.workspace_bytes))
    return held <= sum(d.memory_bytes for d in sub.devices)


class _Planner:
    """Plans groups once per (signature, share) and keeps the results."""

    def __init__(
        self, instance: PlanningInstance, micro_batch_size: int, solver: str, seconds: float, gap: float
    ):
        self.instance, self.b, self.solver, self.seconds, self.gap = (
            instance,
            micro_batch_size,
            solver,
            seconds,
            gap,
        )
        self.cache: dict[tuple, tuple[PlanResult, float, float] | None] = {}
        self.proxy = False  # screening: plan `averaged_precisions` (a fast estimate)
        self.every_share = True  # solve each share; else solve one share and evaluate the others
        self.memory = False  # concurrency by memory (`instance` then has no host memory)
        self.cap = instance.micro_batches  # most micro-batches one group may hold
        self.island = island_of(instance)  # per device: its network island (regions plan apart)

    def signature(self, devices: tuple[int, ...]) -> tuple:
        """Device types, which of them share a node and which network island each is on: groups alike
        in all three plan alike."""
        nodes = Counter(self.instance.devices[j].node for j in devices)
        return tuple(
            sorted(
                (self.instance.devices[j].gpu_type, nodes[self.instance.devices[j].node], self.island[j])
                for j in devices
            )
        )

    def curve(self, devices: tuple[int, ...]) -> dict[int, tuple[PlanResult, float, float]]:
        """The group's plan at each share k = 1..m it can serve: {k: (plan, throughput, upper)}."""
        if self.memory:
            return self._memory_curve(devices)
        m = self.instance.micro_batches
        if self.every_share:
            planned = {k: self.plan(devices, k) for k in range(1, m + 1)}
            return {k: p for k, p in planned.items() if p is not None}
        held = [k for k in range(1, m + 1) if holds_model(share(self.instance, k), devices)]
        if not held:
            return {}
        base = self.plan(devices, held[-1])
        if base is None:
            return {}
        out = {}
        for k in held:
            sub = self._instance(devices, k)
            evaluation = evaluate(sub, base[0].solution)
            if evaluation.feasible:
                upper = base[2] if k == held[-1] else math.inf
                out[k] = (replace(base[0], evaluation=evaluation), self._tok_s(sub, evaluation), upper)
        return out

    def _memory_curve(self, devices: tuple[int, ...]) -> dict[int, tuple[PlanResult, float, float]]:
        """Concurrency by memory: plans at the most micro-batches the group's memory could hold (and
        fewer, `MEMORY_TRIES`; with `every_share` also every k up to `EVERY_K_UP_TO`), each placement
        then serving any k up to what its stages hold ({k: (plan at k, throughput, upper)})."""
        limit = group_memory_limit(self.instance, devices, self.cap)
        if limit == 0:
            return {}
        tries = sorted({max(1, math.floor(f * limit)) for f in MEMORY_TRIES}, reverse=True)
        if self.every_share:
            tries = sorted({*tries, *range(1, min(limit, EVERY_K_UP_TO) + 1)}, reverse=True)
        out: dict[int, tuple[PlanResult, float, float]] = {}
        for k in tries:
            planned = self.plan(devices, k)
            if planned is None:
                continue
            result, _, upper = planned
            held = memory_micro_batches(self._instance(devices, k), result.evaluation)
            most = min(math.floor(held), self.cap)
            for j, throughput in enumerate(self._memory_tok_s(result.evaluation, most), start=1):
                if j not in out or throughput > out[j][1] * (1 + 1e-12):
                    out[j] = (result, throughput, upper if j == k else math.inf)  # evaluated at k
            if not self.every_share:
                break  # screening: the first placement found (the most micro-batches) ranks the group
        return out

    def _memory_tok_s(self, evaluation, most: int) -> list[float]:
        """Throughput of one placement at k = 1..most micro-batches (no offloading: stage times do not
        depend on k; `tessel.plan.report.predict`'s formula)."""
        n_out = self.instance.decode_weight / self.instance.prefill_weight
        pre = [s.time_prefill_s for s in evaluation.stages]
        dec = [s.time_decode_s for s in evaluation.stages]
        out = []
        for k in range(1, most + 1):
            total = sum(pre) + (k - 1) * max(pre) + n_out * (sum(dec) + (k - 1) * max(dec))
            out.append(k * self.b * n_out / total if total > 0 else 0.0)
        return out

    def holds(self, devices: tuple[int, ...], k: int) -> bool:
        if self.memory:
            return holds_model(with_micro_batches(self.instance, k), devices, gpu_only=True)
        return holds_model(share(self.instance, k), devices)

    def plan(self, devices: tuple[int, ...], k: int) -> tuple[PlanResult, float, float] | None:
        """(the group's plan at share k, its throughput, the throughput at its lower bound) or None.

        A group alike to one planned before reuses that plan (its devices in the same canonical
        order: by type, node, name), re-evaluated on this group's own links."""
        key = (self.signature(devices), k)
        if key not in self.cache:
            self.cache[key] = self._solve(devices, k)
            return self.cache[key]
        cached = self.cache[key]
        if cached is None:
            return None
        result, _, _ = cached
        sub = self._instance(devices, k)
        evaluation = evaluate(sub, result.solution)
        if not evaluation.feasible:
            return self._solve(devices, k)
        throughput = self._tok_s(sub, evaluation)
        upper = _upper(throughput, evaluation.objective, result.bound)
        return replace(result, evaluation=evaluation), throughput, upper

    def _tok_s(self, sub: PlanningInstance, evaluation) -> float:
        return predict(sub, evaluation, self.b).throughput_tok_s

    def _instance(self, devices: tuple[int, ...], k: int) -> PlanningInstance:
        group = subset(self.instance, devices)
        sub = with_micro_batches(group, k) if self.memory else share(group, k)
        return averaged_precisions(sub) if self.proxy else sub

    def _solve(self, devices: tuple[int, ...], k: int):
        if not self.holds(devices, k):
            return None
        sub = self._instance(devices, k)
        try:
            result = solve(sub, solver=self.solver, time_limit_s=self.seconds, mip_gap=self.gap)
        except TesselError:
            return None
        throughput = self._tok_s(sub, result.evaluation)
        return result, throughput, _upper(throughput, result.evaluation.objective, result.bound)


def _refine(planner: _Planner, best: tuple, deadline: float, screen_s: float) -> tuple:
    """The chosen split's kinds of group planned again at their shares with the time left (and with
    the real precision choice when screening used the relaxed one); better plans, or every plan after
    a relaxed screening, replace the screened ones."""
    proxy = planner.proxy
    kinds: dict[tuple, list[int]] = {}
    for position, (group, k, _) in enumerate(best[1]):
        kinds.setdefault((planner.signature(group), k), []).append(position)
    seconds = (deadline - time.perf_counter()) / max(1, len(kinds))
    if not proxy and seconds <= 1.5 * screen_s:
        return best
    planner.seconds, planner.proxy = max(seconds, MIN_REPLICA_TIME_S), False
    planned = list(best[1])
    for key, positions in kinds.items():
        planner.cache.pop(key, None)
        for position in positions:
            group, k, old = planned[position]
            again = planner.plan(group, k)
            if again is not None and (proxy or again[1] >= old[1]):  # ties: the new one has a bound
                planned[position] = (group, k, again)
            elif proxy:
                planned[position] = (group, k, None)
    planned = [(g, k, p) for g, k, p in planned if p is not None]
    return sum(p[1] for _, _, p in planned), planned


def _upper(throughput: float, objective: float, bound: float | None) -> float:
    """Throughput at the proven lower bound on the objective (throughput is m b n_out / objective)."""
    if bound is None or bound <= 0:
        return math.inf
    return throughput * objective / bound


def averaged_precisions(instance: PlanningInstance) -> PlanningInstance:
    """A fast stand-in for ranking splits: the budget filled on one stage (`fill_budget`), then every
    unit given the mean bytes and times of that precision vector, so the units are alike and the
    counts relaxation plans it. Not a plan of the instance and not a bound; the chosen split is
    planned for real afterwards."""
    from tessel.plan.solution import Solution, Stage
    from tessel.plan.solvers.precision_search import fill_budget

    if instance.precision is None:
        return instance
    vector = fill_budget(instance, Solution((Stage(0, 0, instance.n_units),)))
    fixed = instance.fixed(vector)

    def mean(costs: PassCosts) -> PassCosts:
        return replace(
            costs, unit_time_s=np.broadcast_to(costs.unit_time_s.mean(axis=0), costs.unit_time_s.shape).copy()
        )

    return replace(
        fixed,
        prefill=mean(fixed.prefill),
        decode=mean(fixed.decode),
        weight_bytes=np.full(instance.n_units, float(fixed.weight_bytes.mean())),
    )


def canonical_group(instance: PlanningInstance, devices) -> tuple[int, ...]:
    return tuple(
        sorted(
            devices,
            key=lambda j: (instance.devices[j].gpu_type, instance.devices[j].node, instance.devices[j].name),
        )
    )


def choose_replicas(
    instance: PlanningInstance,
    micro_batch_size: int,
    settings: ReplicaSettings = ReplicaSettings(),
    *,
    _single: bool = True,
) -> ReplicaPlan:
    """The split of the devices into `settings.replicas` pipelines (None: the best count) and of the
    requests in flight among them (`concurrency`: shares of the workload's m micro-batches, or as many
    as each replica's memory holds, at most `max_micro_batches` in all) with the most summed
    throughput, each replica planned as a pipeline, and the routing weights. Never less than the whole
    cluster as one pipeline at the workload's m when that is allowed (`replicas` None or 1)."""
    replicas, solver, time_limit_s = settings.replicas, settings.solver, settings.time_limit_s
    mip_gap, concurrency, cap = settings.mip_gap, settings.concurrency, settings.max_micro_batches
    started = time.perf_counter()
    if concurrency not in CONCURRENCY_MODES:
        raise TesselError(f"unknown concurrency {concurrency!r}; use one of {', '.join(CONCURRENCY_MODES)}")
    if cap is not None and cap < 1:
        raise TesselError(f"the most micro-batches in flight must be >= 1, got {cap}")
    if replicas is not None and replicas < 1:
        raise TesselError(f"--replicas must be 'auto' or a count >= 1, got {replicas}")
    memory = concurrency == "memory"
    n, m = instance.n_devices, instance.micro_batches
    single = None
    if _single and replicas in (None, 1):
        seconds = SINGLE_TIME_SHARE * time_limit_s
        single = _single_pipeline(instance, micro_batch_size, solver, seconds, mip_gap)
    memory_bound = pipelines_bound = math.inf
    if memory:
        left = max(time_limit_s - (time.perf_counter() - started), MIN_REPLICA_TIME_S)
        memory_bound = _memory_bound(instance, micro_batch_size, cap, min(MEMORY_BOUND_S, left))
        pipelines_bound = _pipelines_bound(instance, micro_batch_size, cap, min(MEMORY_BOUND_S, left))
    time_limit_s = max(time_limit_s - (time.perf_counter() - started), MIN_REPLICA_TIME_S)
    started_splits = time.perf_counter()
    exhaustive = n <= EXHAUSTIVE_DEVICES
    base = gpu_memory_only(instance) if memory else instance
    splits = list(_partitions(list(range(n)))) if exhaustive else _candidate_splits(share(base, 1))
    planner = _Planner(base, micro_batch_size, solver, 0.0, mip_gap)
    planner.every_share = exhaustive
    planner.memory = memory
    if memory:
        planner.cap = min(MAX_MICRO_BATCHES, cap or MAX_MICRO_BATCHES)
    budget = m if not memory else cap
    kinds = {planner.signature(canonical_group(instance, g)) for split in splits for g in split}
    screen_s = max(MIN_REPLICA_TIME_S, SCREEN_TIME_SHARE * time_limit_s / max(1, len(kinds)))
    planner.seconds = screen_s
    planner.proxy = not exhaustive and instance.precision is not None
    best, evaluated, largest = None, 0, 0
    split_deadline = started_splits + time_limit_s
    for split in splits:
        spent = time.perf_counter() - started_splits
        fallback = best is not None or single is not None  # a plan to return when time runs out
        if fallback and (spent > time_limit_s or (planner.proxy and spent > SCREEN_STOP * time_limit_s)):
            exhaustive = False
            break
        split = [canonical_group(instance, g) for g in split]
        curves = []
        for g in split:  # planned one by one: none starts that its solve's time would carry past the limit
            if fallback and time.perf_counter() + planner.seconds > split_deadline:
                break
            curves.append(planner.curve(g))
        if len(curves) < len(split):
            exhaustive = False
            break
        served = sum(bool(c) for c in curves)
        largest = max(largest, served if budget is None else min(budget, served))
        values = [{k: p[1] for k, p in c.items()} for c in curves]
        found = _best_each(values, replicas) if budget is None else allocate(values, budget, replicas)
        if found is None:
            continue
        evaluated += 1
        total, ks = found
        if best is None or total > best[0] * (1 + 1e-9):
            planned = [(g, k, c[k]) for g, k, c in zip(split, ks, curves, strict=True) if k > 0]
            best = (total, planned)
    if best is not None and not exhaustive:
        deadline = started_splits + (MEMORY_SEARCH_SHARE if memory else REFINE_END) * time_limit_s
        best = _refine(planner, best, deadline, screen_s)
    fixed_plan = None
    left = time_limit_s - (time.perf_counter() - started_splits)
    # the fixed shares (offloading allowed) are candidates too: never worse than them, time allowing
    if memory and (left >= MIN_REPLICA_TIME_S or (best is None and single is None)):
        try:
            fixed = replace(settings, time_limit_s=left, concurrency="fixed", max_micro_batches=None)
            fixed_plan = choose_replicas(instance, micro_batch_size, fixed, _single=False)
        except TesselError:
            fixed_plan = None
        if fixed_plan is not None and (best is None or fixed_plan.throughput_tok_s > best[0] * (1 + 1e-9)):
            best = None
    single_tok_s = 0.0 if single is None else single[1]
    fixed_tok_s = 0.0 if fixed_plan is None else fixed_plan.throughput_tok_s
    if single is not None and (best is None or single[1] > best[0] * (1 + 1e-9)) and single[1] >= fixed_tok_s:
        chosen = (Replica(tuple(range(n)), instance, single[0], single[1], single[2], 1.0, m),)
        best = (single[1], None)
    elif best is None and fixed_plan is not None:
        chosen, best = fixed_plan.replicas, (fixed_tok_s, None)
        evaluated += fixed_plan.splits_evaluated
    elif best is not None:
        weights = routing_weights([p[1] for _, _, p in best[1]])
        chosen = tuple(
            _replica(base, planner, g, k, p, w, memory) for (g, k, p), w in zip(best[1], weights, strict=True)
        )
    if best is None and replicas is not None and largest > 0:
        raise TesselError(
            f"{replicas} replicas cannot each hold the model on these {n} devices; the largest feasible "
            f"count tessel found is {largest}"
        )
    if best is None and memory:
        _refuse_unheld_layers(base)
    if best is None:
        raise TesselError("no group of these devices can hold the model; add GPUs or host memory")
    from tessel.plan.replicas.replica_bound import split_upper_bound_tok_s

    return ReplicaPlan(
        chosen,
        best[0],
        sum(r.upper_bound_tok_s for r in chosen),
        evaluated,
        exhaustive,
        time.perf_counter() - started,
        memory_bound if memory else split_upper_bound_tok_s(instance, micro_batch_size),
        concurrency,
        single_tok_s,
        min(pipelines_bound, memory_bound),
    )


def _replica(base, planner: _Planner, group, k: int, planned, weight: float, memory: bool) -> Replica:
    """The chosen group at its k, its plan evaluated there (memory mode plans at one k and serves any
    k its stages hold)."""
    result, throughput, upper = planned
    sub = planner._instance(group, k) if memory else share(subset(base, group), k)
    if memory:
        result = replace(result, evaluation=evaluate(sub, result.solution))
    return Replica(group, sub, result, throughput, upper, weight, k)


def unheld_units(instance: PlanningInstance) -> list[int]:
    """Units that no device's memory holds with the KV of one micro-batch (its workspace, and the
    embedding / LM head for the first / last unit, included): no path from the first layer to the
    last exists through them without offloading."""
    one = with_micro_batches(instance.relaxed(), 1)
    memory = np.array([d.memory_bytes for d in one.devices]) * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_BYTES
    least = memory - np.asarray(one.workspace_bytes, dtype=float)
    need = np.asarray(one.weight_bytes, dtype=float) + np.asarray(one.kv_bytes, dtype=float)
    need = need.copy()
    need[0] += one.first_bytes
    need[-1] += one.last_bytes
    return [u for u in range(one.n_units) if not np.any(need[u] <= least)]


def _refuse_unheld_layers(instance: PlanningInstance) -> None:
    units = unheld_units(instance)
    if not units:
        return
    first, last = instance.units[units[0]].layer, instance.units[units[-1]].layer
    span = f"layer {first}" if first == last else f"layers {first}-{last}"
    raise TesselError(
        f"no GPU's memory holds {span} with the KV of one micro-batch, so no path of GPUs covers the "
        f"model from layer 0 to layer {instance.units[-1].layer} without offloading; add GPUs with more "
        "memory, or plan with --concurrency fixed (offloading to host memory)"
    )


def _memory_bound(
    instance: PlanningInstance, b: int, cap: int | None, seconds: float, pipelines: bool = False
) -> float:
    """The memory-and-requests-in-flight bound over every split held in GPU memory
    (`tessel.plan.solvers.memory_bound`, its LP; inf when HiGHS gives none within `seconds`); with
    `pipelines`, the pipeline fill counted too (disjoint pipelines only)."""
    from tessel.plan.solvers.memory_bound import memory_flow_bound

    bound = memory_flow_bound(instance, b, max_micro_batches=cap, time_limit_s=seconds, pipelines=pipelines)
    return bound.throughput_tok_s


def _pipelines_bound(instance: PlanningInstance, b: int, cap: int | None, seconds: float) -> float:
    """The least of the bounds over disjoint pipelines served by memory: the memory LP with the
    pipeline fill (`memory_flow_bound(pipelines=True)`) and the compositions LP
    (`tessel.plan.solvers.pipeline_bound`)."""
    from tessel.plan.solvers.pipeline_bound import pipelines_bound_tok_s

    filled = _memory_bound(instance, b, cap, seconds, pipelines=True)
    return min(filled, pipelines_bound_tok_s(instance, b, cap))


def _single_pipeline(instance: PlanningInstance, b: int, solver: str, seconds: float, gap: float):
    """(plan, throughput, upper) of the whole cluster as one pipeline at the workload's m, or None."""
    try:
        result = solve(instance, solver=solver, time_limit_s=max(seconds, MIN_REPLICA_TIME_S), mip_gap=gap)
    except TesselError:
        return None
    throughput = predict(instance, result.evaluation, b).throughput_tok_s
    return result, throughput, _upper(throughput, result.evaluation.objective, result.bound)


def _best_each(curves: list[dict[int, float]], count: int | None):
    """With no total budget: each group at its best k (groups independent); with `count`, the
    `count` groups with the most. (total, shares) or None."""
    tops = [max(c.items(), key=lambda kv: (kv[1], -kv[0])) if c else (0, 0.0) for c in curves]
    order = sorted((i for i, c in enumerate(curves) if c), key=lambda i: -tops[i][1])
    if count is not None:
        if len(order) < count:
            return None
        order = order[:count]
    if not order:
        return None
    keep = set(order)
    ks = tuple(tops[i][0] if i in keep else 0 for i in range(len(curves)))
    return sum(tops[i][1] for i in keep), ks


def _partitions(items: list[int]):
    """Every set partition of `items` (as lists of groups)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _partitions(rest):
        yield [[first], *partition]
        for i in range(len(partition)):
            yield [*partition[:i], [first, *partition[i]], *partition[i + 1 :]]


def _candidate_splits(instance: PlanningInstance) -> list[list[list[int]]]:
    """On a cluster of several network islands (regions, `islands.network_islands`), splits inside
    the islands first: each island whole, the islands of the same GPU types joined
    (`_join_alike_islands`), and each island's own type splits side by side. Then
    same-type groups (smallest that holds the model, and twice that), leftovers pooled into mixed
    groups by memory; and the whole cluster as one pipeline."""
    by_type = _by_type(instance, range(instance.n_devices))
    splits = []
    islands = network_islands(instance)
    if len(islands) > 1:
        whole = [list(island) for island in islands if holds_model(instance, island)]
        if whole:
            splits.append(whole)
        joined = _join_alike_islands(instance, islands)
        if joined is not None and joined not in splits:
            splits.append(joined)
        inside = [_type_splits(instance, _by_type(instance, island)) for island in islands]
        for variant in range(len(TYPE_SPLIT_VARIANTS)):
            groups = [g for island in inside for g in island[variant]]
            if groups and groups not in splits:
                splits.append(groups)
    for groups in _type_splits(instance, by_type):
        if groups and groups not in splits:
            splits.append(groups)
    for k in SPREAD_REPLICAS:  # mixed: every replica gets 1/k of each type
        groups = [[] for _ in range(k)]
        for members in by_type.values():
            for i, j in enumerate(members):
                groups[i * k // len(members)].append(j)
        groups = [g for g in groups if g]
        if all(holds_model(instance, tuple(g)) for g in groups) and groups not in splits:
            splits.append(groups)
    return [*splits, [list(range(instance.n_devices))]]  # the whole cluster last: the slowest to plan


def _join_alike_islands(instance: PlanningInstance, islands: list[tuple[int, ...]]) -> list[list[int]] | None:
    """The islands with the same GPU types joined into one group each (a pipeline that crosses the slow
    link, but holds more micro-batches' KV than either island alone); None when no two are alike."""
    joined: dict[frozenset[str], list[int]] = {}
    for island in islands:
        joined.setdefault(frozenset(instance.devices[j].gpu_type for j in island), []).extend(island)
    if len(joined) == len(islands):
        return None
    return list(joined.values())


def _by_type(instance: PlanningInstance, devices) -> dict[str, list[int]]:
    """The devices by GPU type, each type's in node order."""
    by_type: dict[str, list[int]] = {}
    for j in devices:
        by_type.setdefault(instance.devices[j].gpu_type, []).append(j)
    for members in by_type.values():
        members.sort(key=lambda j: (instance.devices[j].node, instance.devices[j].name))
    return by_type


def _type_splits(instance: PlanningInstance, by_type: dict[str, list[int]]) -> list[list[list[int]]]:
    """Per `TYPE_SPLIT_VARIANTS` (GPU memory only or with host memory; groups of 1, 2, 4 times the
    smallest size that holds the model): same-type groups, the devices left pooled by memory."""
    smallest = {t: smallest_group(instance, members) for t, members in by_type.items()}
    splits = []
    for gpu_only, factor in TYPE_SPLIT_VARIANTS:
        groups, left = [], []
        for t, members in by_type.items():
            size = smallest[t][gpu_only]
            if size is None:
                left += members
                continue
            size = min(size * factor, len(members))
            count = len(members) // size
            groups += [members[i * size : (i + 1) * size] for i in range(count)]
            left += members[count * size :]
        groups += _pool(instance, left, gpu_only)
        splits.append(groups)
    return splits


def smallest_group(instance: PlanningInstance, members: list[int]) -> dict[bool, int | None]:
    out = {}
    for gpu_only in (True, False):
        out[gpu_only] = next(
            (k for k in range(1, len(members) + 1) if holds_model(instance, tuple(members[:k]), gpu_only)),
            None,
        )
    return out


def _pool(instance: PlanningInstance, left: list[int], gpu_only: bool) -> list[list[int]]:
    """Mixed groups from leftover devices: most memory first, each closed once it holds the model;
    a last group that cannot is merged into the one before it."""
    order = sorted(left, key=lambda j: -instance.devices[j].memory_bytes)
    groups, current = [], []
    for j in order:
        current.append(j)
        if holds_model(instance, tuple(current), gpu_only):
            groups.append(current)
            current = []
    if current:
        if groups:
            groups[-1] += current
        elif holds_model(instance, tuple(current)):
            groups.append(current)
    return groups


def replica_gap(plan: ReplicaPlan) -> float | None:
    """Relative gap of the split's throughput to its upper bound (None: no bound)."""
    if not math.isfinite(plan.upper_bound_tok_s) or plan.upper_bound_tok_s <= 0:
        return None
    return max(plan.upper_bound_tok_s - plan.throughput_tok_s, 0.0) / plan.upper_bound_tok_s


def split_gap(plan: ReplicaPlan) -> float | None:
    """Relative gap of the split's throughput to the bound over every split (None: no bound)."""
    bound = plan.split_bound_tok_s
    if not math.isfinite(bound) or bound <= 0:
        return None
    return max(bound - plan.throughput_tok_s, 0.0) / bound
