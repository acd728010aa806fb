"""Placements and flow chosen together in one MILP (HiGHS), the search behind `tessel.plan.flow.flow`.

Devices are grouped (`device_groups`): a group is devices of one GPU type on one node (or one
device per group on small clusters); the devices of a group hold the same range and share its flow
in parallel. For group g (n_g devices) and unit u, with w_ug = prefill + n_out decode time of unit
u on g's type, kv_u / wt_u the KV of one micro-batch / weights of unit u:

    h_ug in {0, 1}       g holds unit u (one contiguous run: s_ug >= h_ug - h_(u-1)g, sum_u s_ug <= 1)
    x_g >= 0             micro-batches per second through g (all its devices)
    a_ug = x_g h_ug      (a <= x, a <= X_g h, a >= x - X_g (1 - h))
    sum_g a_ug = F       every unit crossed at the plan's rate F; with contiguity this is flow
                         conservation at every unit boundary (what ends at l starts at l)
    busy:   sum_u w_ug a_ug + first_g a_0g + last_g a_(U-1)g + send_g sum_u e_ug <= eta n_g
            (e_ug >= a_ug - a_(u+1)g: the rate leaving g after unit u, charged its send time)
    Little: c_ug >= lifetime a_ug   (micro-batches whose unit-u KV is on g)
    memory: n_g (sum_u wt_u h_ug + first h_0g + last h_(U-1)g) + sum_u kv_u c_ug
                <= n_g (memory_g - workspace_g)

maximise F. `lifetime` (seconds a micro-batch stays in flight) and `eta` (utilisation target) are
the model's two knobs: the pipeline formula that prices the plan (`evaluate_flow`) is not linear, so
`solve_flow` solves a few (lifetime, eta) pairs and keeps the plan `evaluate_flow` prices best.
With placements fixed, the MILP's F is a max flow over the placement graph with node capacities
min(eta n_g / W_g, n_g free_g / (lifetime kv_g)) (W_g: the group's time per micro-batch on its
range, free_g / kv_g: its memory after weights / its KV per micro-batch), which is what the tests'
brute force computes. Identical groups are ordered by rate (symmetry). Warm starts: the best of the
placements given (`tessel.plan.flow.flow_choice.search_flow` gives its candidates' where every GPU of a
group holds one range on block boundaries) and same-type chains (`chain_seeds`), handed to HiGHS as
a full solution; on the time limit the best incumbent is used and its gap to HiGHS's dual bound
reported. Beyond `MAX_BINARIES` placement binaries, units are merged into near-equal blocks
(`block_cuts`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from tessel.errors import TesselError
from tessel.plan.flow.flow import FlowPlan, flow_instance, max_flow, placement_edges, route_placements
from tessel.plan.flow.swarm import greedy_routed
from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import FEASIBILITY_ATOL_BYTES, FEASIBILITY_RTOL, Stage
from tessel.plan.solvers.highs import ModelBuilder, solve_mip

PER_DEVICE_GROUPS = 8  # up to this many devices, one device per group
MAX_BINARIES = 2000  # placement binaries h_ug: units are merged into blocks beyond it
ETAS = (1.0,)
LIFETIME_FACTORS = (0.25, 0.5, 1.0)  # times the lifetime at which all free memory is just full
MIN_SOLVE_S = 0.5


@dataclass(frozen=True, slots=True)
class FlowModel:
    """The MILP's numbers per group (arrays [G, U] / [G])."""

    groups: tuple[tuple[int, ...], ...]
    size: np.ndarray  # n_g
    work: np.ndarray  # [G, U] w_ug
    first: np.ndarray  # [G]
    last: np.ndarray
    send: np.ndarray  # [G]: time to send one micro-batch's hidden states off the group (both passes)
    weights: np.ndarray  # [U]
    kv: np.ndarray  # [U]: one micro-batch
    first_bytes: float
    last_bytes: float
    room: np.ndarray  # [G]: memory - workspace per device
    lifetime_s: float
    eta: float
    cuts: np.ndarray  # [B + 1]: the model's unit b is the instance's units cuts[b]..cuts[b + 1]

    @property
    def n_units(self) -> int:
        return self.work.shape[1]

    def units(self, r: tuple[int, int]) -> tuple[int, int]:
        """The instance's unit range of a range of the model's blocks."""
        return int(self.cuts[r[0]]), int(self.cuts[r[1]])


@dataclass(frozen=True, slots=True)
class FlowMILP:
    ranges: tuple[tuple[int, int] | None, ...]  # per group: (unit_start, unit_end) or None
    rates: np.ndarray  # x_g
    value: float  # F
    bound: float  # HiGHS's dual bound on F (inf: none)
    gap: float
    status: str
    time_s: float


@dataclass(frozen=True, slots=True)
class FlowSearch:
    plan: FlowPlan | None
    milps: tuple[FlowMILP, ...]
    time_s: float
    source: str = "milp"  # which search gave `plan`: "milp" or a candidate's name


def device_groups(instance: PlanningInstance) -> tuple[tuple[int, ...], ...]:
    """One device per group up to `PER_DEVICE_GROUPS` devices, else devices of a type on a node."""
    if instance.n_devices <= PER_DEVICE_GROUPS:
        return tuple((j,) for j in range(instance.n_devices))
    groups: dict[tuple[str, str], list[int]] = {}
    for j, d in enumerate(instance.devices):
        groups.setdefault((d.node, d.gpu_type), []).append(j)
    return tuple(tuple(g) for g in groups.values())


def block_cuts(n_units: int, n_groups: int) -> np.ndarray:
    """Unit boundaries of the MILP's blocks: units merged into near-equal blocks so that the MILP has
    at most `MAX_BINARIES` placement binaries (every unit its own block when that fits)."""
    blocks = max(1, min(n_units, MAX_BINARIES // max(n_groups, 1)))
    return np.round(np.linspace(0, n_units, blocks + 1)).astype(int)


def flow_model(
    instance: PlanningInstance, groups, lifetime_s: float, eta: float = 1.0, cuts: np.ndarray | None = None
) -> FlowModel:
    one = flow_instance(instance)
    n_out = one.decode_weight / one.prefill_weight
    rep = np.array([g[0] for g in groups])
    cuts = np.arange(one.n_units + 1) if cuts is None else np.asarray(cuts, dtype=int)

    def merged(per_unit: np.ndarray) -> np.ndarray:
        return np.add.reduceat(per_unit, cuts[:-1], axis=0)

    work = merged(one.prefill.unit_time_s + n_out * one.decode.unit_time_s)[:, rep].T
    first = (one.prefill.first_time_s + n_out * one.decode.first_time_s)[rep]
    last = (one.prefill.last_time_s + n_out * one.decode.last_time_s)[rep]
    sends = one.prefill.send_s + n_out * one.decode.send_s
    send = []
    for g in groups:
        others = [k for k in range(one.n_devices) if k not in g]
        send.append(max((float(sends[g[0], k]) for k in others), default=0.0))
    memory = (
        np.array([one.devices[j].memory_bytes for j in rep]) * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_BYTES
    )
    return FlowModel(
        tuple(tuple(g) for g in groups),
        np.array([len(g) for g in groups], dtype=float),
        work,
        first,
        last,
        np.array(send),
        merged(np.asarray(one.weight_bytes, dtype=float)),
        merged(np.asarray(one.kv_bytes, dtype=float)),
        float(one.first_bytes),
        float(one.last_bytes),
        memory - np.asarray(one.workspace_bytes, dtype=float)[rep],
        float(lifetime_s),
        float(eta),
        cuts,
    )


def group_capacity(model: FlowModel, g: int, start: int, end: int) -> float:
    """Rate x_g the MILP allows group g holding units [start, end) (-1: it cannot hold them)."""
    n = model.n_units
    fixed = model.weights[start:end].sum() + (model.first_bytes if start == 0 else 0.0)
    fixed += model.last_bytes if end == n else 0.0
    free = model.room[g] - fixed
    if free < 0:
        return -1.0
    busy = model.work[g, start:end].sum() + (model.first[g] if start == 0 else 0.0)
    busy += (model.last[g] if end == n else 0.0) + (model.send[g] if end < n else 0.0)
    kv = model.kv[start:end].sum() * model.lifetime_s
    cap = model.eta * model.size[g] / busy if busy > 0 else math.inf
    if kv > 0:
        cap = min(cap, model.size[g] * free / kv)
    return cap


def placement_value(model: FlowModel, ranges) -> tuple[float, np.ndarray] | None:
    """F and x_g of fixed placements (None: some group cannot hold its range)."""
    caps, stages = {}, []
    for g, r in enumerate(ranges):
        if r is None:
            continue
        cap = group_capacity(model, g, *r)
        if cap < 0:
            return None
        caps[g] = cap
        stages.append(Stage(g, r[0], r[1]))
    value, flow = max_flow(placement_edges(stages, model.n_units), caps)
    rates = np.zeros(len(model.groups))
    for (a, _), f in flow.items():
        if a >= 0:
            rates[a] += f
    return value, rates


def solve_flow_milp(
    model: FlowModel,
    time_limit_s: float,
    starts=(),
    mip_gap: float = 1e-4,
    max_flow_rate: float | None = None,
) -> FlowMILP:
    started = time.perf_counter()
    mb, cols = _build(model, max_flow_rate)
    best_start = None
    for ranges in starts:
        found = placement_value(model, ranges)
        if found is not None and (best_start is None or found[0] > best_start[0][0]):
            best_start = (found, ranges)
    start = None
    if best_start is not None:
        start = _start_values(model, cols, mb.n_cols, best_start[1], best_start[0][1])
    solved = solve_mip(mb, started=started, time_limit_s=time_limit_s, mip_gap=mip_gap, start=start)
    elapsed = time.perf_counter() - started
    bound = -solved.dual_bound if math.isfinite(solved.dual_bound) else math.inf
    if solved.values is None:
        return FlowMILP(
            (None,) * len(model.groups),
            np.zeros(len(model.groups)),
            0.0,
            bound,
            math.inf,
            solved.status,
            elapsed,
        )
    values = solved.values
    held = values[cols["h"]] > 0.5
    ranges = []
    for g in range(len(model.groups)):
        units = np.flatnonzero(held[g])
        ranges.append((int(units[0]), int(units[-1]) + 1) if len(units) else None)
    value = -solved.objective
    gap = max(bound - value, 0.0) / bound if bound > 0 and math.isfinite(bound) else 0.0
    return FlowMILP(tuple(ranges), values[cols["x"]], value, bound, gap, solved.status, elapsed)


def _build(model: FlowModel, max_flow_rate: float | None):
    G, U = model.work.shape
    mb = ModelBuilder()
    h = mb.cols((G, U), 0.0, 1.0, integer=True)
    a = mb.cols((G, U))
    c = mb.cols((G, U))
    s = mb.cols((G, U), 0.0, 1.0)
    e = mb.cols((G, U))
    x = mb.cols((G,))
    f = mb.cols((1,), 0.0, np.inf if max_flow_rate is None else max_flow_rate)[0]
    mb.cost[f] = -1.0
    big = np.array([_big_m(model, g) for g in range(G)])
    xs = np.repeat(x[:, None], U, axis=1)
    bigs = np.repeat(big[:, None], U, axis=1)
    flat = lambda m: m.reshape(-1)  # noqa: E731
    inf = np.inf
    mb.rows(np.stack([flat(a), flat(xs)], 1), np.array([1.0, -1.0]), -inf, 0.0)  # a <= x
    mb.rows(np.stack([flat(a), flat(h)], 1), np.stack([np.ones(G * U), -flat(bigs)], 1), -inf, 0.0)
    mb.rows(
        np.stack([flat(a), flat(xs), flat(h)], 1),
        np.stack([np.ones(G * U), -np.ones(G * U), -flat(bigs)], 1),
        -flat(bigs),
        inf,
    )  # a >= x - X (1 - h)
    mb.rows(np.concatenate([a.T, np.full((U, 1), f)], 1), np.concatenate([np.ones(G), [-1.0]]), 0.0, 0.0)
    for g in range(G):  # busy
        vals = model.work[g].copy()
        vals[0] += model.first[g]
        vals[-1] += model.last[g]
        mb.rows(
            np.concatenate([a[g], e[g, :-1]])[None],
            np.concatenate([vals, np.full(U - 1, model.send[g])])[None],
            -inf,
            model.eta * model.size[g],
        )
    if U > 1:  # e >= a_u - a_(u+1)
        mb.rows(
            np.stack([flat(e[:, :-1]), flat(a[:, :-1]), flat(a[:, 1:])], 1),
            np.array([1.0, -1.0, 1.0]),
            0.0,
            inf,
        )
    for g in range(G):  # memory
        wt = model.weights * model.size[g]
        wt = wt.copy()
        wt[0] += model.first_bytes * model.size[g]
        wt[-1] += model.last_bytes * model.size[g]
        scale = max(model.room[g], 1.0)
        mb.rows(
            np.concatenate([h[g], c[g]])[None],
            (np.concatenate([wt, model.kv]) / scale)[None],
            -inf,
            model.size[g] * model.room[g] / scale,
        )
    mb.rows(np.stack([flat(c), flat(a)], 1), np.array([1.0, -model.lifetime_s]), 0.0, inf)  # Little
    mb.rows(np.stack([s[:, 0], h[:, 0]], 1), np.array([1.0, -1.0]), 0.0, inf)
    if U > 1:
        mb.rows(
            np.stack([flat(s[:, 1:]), flat(h[:, 1:]), flat(h[:, :-1])], 1),
            np.array([1.0, -1.0, 1.0]),
            0.0,
            inf,
        )
    mb.rows(s, np.ones(U), -inf, 1.0)
    for g, nxt in _identical_pairs(model):  # symmetry: identical groups ordered by rate
        mb.rows(np.array([[x[g], x[nxt]]]), np.array([1.0, -1.0]), 0.0, inf)
    return mb, {"h": h, "a": a, "c": c, "s": s, "e": e, "x": x, "f": f}


def _big_m(model: FlowModel, g: int) -> float:
    """Most rate group g can carry: holding its cheapest unit alone, all its time."""
    least = float(model.work[g].min())
    cap = model.eta * model.size[g] / least if least > 0 else 1e6
    if model.kv.min() > 0 and model.lifetime_s > 0:
        cap = min(cap, model.size[g] * max(model.room[g], 0.0) / (model.lifetime_s * float(model.kv.min())))
    return max(cap, 1e-9)


def _identical_pairs(model: FlowModel) -> list[tuple[int, int]]:
    keys = [
        (model.size[g], model.send[g], model.room[g], model.work[g].tobytes(), model.first[g], model.last[g])
        for g in range(len(model.groups))
    ]
    pairs, last_of = [], {}
    for g, key in enumerate(keys):
        if key in last_of:
            pairs.append((last_of[key], g))
        last_of[key] = g
    return pairs


def _start_values(model: FlowModel, cols: dict, n_cols: int, ranges, rates: np.ndarray) -> np.ndarray:
    G, U = model.work.shape
    values = np.zeros(n_cols)
    for g, r in enumerate(ranges):
        values[cols["x"][g]] = rates[g]
        if r is None:
            continue
        start, end = r
        values[cols["h"][g, start:end]] = 1.0
        values[cols["s"][g, start]] = 1.0
        values[cols["a"][g, start:end]] = rates[g]
        values[cols["c"][g, start:end]] = rates[g] * model.lifetime_s
        if end < U:
            values[cols["e"][g, end - 1]] = rates[g]
    values[cols["f"]] = sum(rates[g] for g, r in enumerate(ranges) if r is not None and r[0] == 0)
    return values


def natural_lifetime_s(instance: PlanningInstance, groups) -> float:
    """Seconds in flight at which the cluster's free memory (after one copy of the weights) holds
    the KV of every micro-batch the devices' combined compute passes: K_mem / F_compute."""
    model = flow_model(instance, groups, 1.0)
    spare = (
        float(np.sum(model.room * model.size)) - model.weights.sum() - model.first_bytes - model.last_bytes
    )
    k_mem = max(spare, 0.0) / model.kv.sum() if model.kv.sum() > 0 else math.inf
    f_compute = float(np.sum(model.size / model.work.sum(axis=1)))
    return k_mem / f_compute if f_compute > 0 else 1.0


def _expand(instance: PlanningInstance, model: FlowModel, milp: FlowMILP):
    """Per-device stages and rates from a group solution (a group's devices split its rate)."""
    stages, rates = [], {}
    for g, r in enumerate(milp.ranges):
        if r is None or milp.rates[g] <= 1e-12:
            continue
        start, end = model.units(r)
        for j in model.groups[g]:
            stages.append(Stage(j, start, end))
            rates[j] = float(milp.rates[g]) / len(model.groups[g])
    return stages, rates


def group_ranges(model: FlowModel, stages) -> list[tuple[tuple[int, int] | None, ...]]:
    """Placements of devices (a pipeline's stages) as block ranges per group, where every device of a
    group holds the same range on block boundaries (else not expressible: an empty list)."""
    block_of = {int(u): b for b, u in enumerate(model.cuts)}
    by_device = {s.device: (s.unit_start, s.unit_end) for s in stages}
    ranges = []
    for g in model.groups:
        held = {by_device.get(j) for j in g}
        if len(held) != 1:
            return []
        r = held.pop()
        if r is not None and (r[0] not in block_of or r[1] not in block_of):
            return []
        ranges.append(None if r is None else (block_of[r[0]], block_of[r[1]]))
    return [tuple(ranges)]


def chain_seeds(model: FlowModel) -> list[tuple[tuple[int, int] | None, ...]]:
    """Same-type chains: each kind of group split into r chains, each chain's groups holding near-
    equal block counts; per kind the r with the most flow. One placement (the union), plus each
    kind's best alone."""
    kinds: dict[tuple, list[int]] = {}
    for g in range(len(model.groups)):
        kinds.setdefault((model.work[g].tobytes(), model.room[g]), []).append(g)
    n_blocks = model.n_units
    union: list[tuple[int, int] | None] = [None] * len(model.groups)
    alone = []
    for members in kinds.values():
        best = None
        for r in range(1, len(members) + 1):
            ranges: list[tuple[int, int] | None] = [None] * len(model.groups)
            for chain in np.array_split(np.array(members), r):
                if len(chain) > n_blocks:
                    chain = chain[:n_blocks]
                cuts = np.round(np.linspace(0, n_blocks, len(chain) + 1)).astype(int)
                for g, a, b in zip(chain, cuts[:-1], cuts[1:], strict=True):
                    ranges[int(g)] = (int(a), int(b))
            found = placement_value(model, ranges)
            if found is not None and found[0] > 0 and (best is None or found[0] > best[0]):
                best = (found[0], ranges)
        if best is not None:
            alone.append(tuple(best[1]))
            for g in members:
                union[g] = best[1][g]
    return [tuple(union), *alone] if alone else []


def solve_flow(
    instance: PlanningInstance,
    micro_batch_size: int,
    *,
    time_limit_s: float = 30.0,
    max_micro_batches: int | None = None,
    seeds=(),
    groups=None,
) -> FlowSearch:
    """Flow plans of the MILP for a few (lifetime, eta) pairs, each placement routed by the MILP's
    max flow and, as Swarm routes, greedily (`tessel.plan.flow.swarm.greedy_routed`), each priced by
    `evaluate_flow`; the best kept. `seeds`: placements (lists of Stage) handed to HiGHS
    as warm starts where the groups allow."""
    started = time.perf_counter()
    groups = device_groups(instance) if groups is None else groups
    natural = natural_lifetime_s(instance, groups)
    cuts = block_cuts(instance.n_units, len(groups))
    pairs = [(natural * f, eta) for f in LIFETIME_FACTORS for eta in ETAS]
    best, milps = None, []
    for index, (lifetime, eta) in enumerate(pairs):
        left = time_limit_s - (time.perf_counter() - started)
        if left < MIN_SOLVE_S:
            break
        model = flow_model(instance, groups, lifetime, eta, cuts)
        starts = [r for seed in seeds for r in group_ranges(model, seed)] + chain_seeds(model)
        cap = None if max_micro_batches is None else max_micro_batches / lifetime
        milp = solve_flow_milp(model, left / (len(pairs) - index), starts, max_flow_rate=cap)
        milps.append(milp)
        stages, rates = _expand(instance, model, milp)
        if not stages:
            continue
        try:
            routed = route_placements(instance, stages, rates, micro_batch_size, max_micro_batches)
        except TesselError:  # placements the incumbent left without a full path
            routed = None
        greedy = greedy_routed(instance, stages, micro_batch_size, max_micro_batches)
        for plan in (routed, greedy):
            if plan is not None and (best is None or plan.throughput_tok_s > best.throughput_tok_s):
                best = plan
    return FlowSearch(best, tuple(milps), time.perf_counter() - started, "milp")


def type_counts(instance: PlanningInstance, plan: FlowPlan) -> Counter:
    return Counter(instance.devices[s.device].gpu_type for s in plan.stages)
