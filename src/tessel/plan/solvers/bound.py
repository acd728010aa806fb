"""A lower bound on the planning objective over every plan, for instances whose units are all alike.

When every unit has the same bytes and the same times (whole decoder layers of one model), a plan
is fixed by which devices it uses, how many units each holds, which is first and which is last,
and the pipeline order; the order only matters through the links. Relax it: a stage that sends
pays its device's cheapest outgoing link (`min_k send[j, k]`), the last stage sends nothing. Every
plan then maps to a choice of (count, role) per device, role one of middle / first / last / only,
with exactly one first and one last, whose relaxed stage times are no larger than the plan's.

For bounds (P, D) on every relaxed prefill / decode stage time, a knapsack over devices with state
(units placed, first taken, last taken) gives the least weighted sum F(P, D). The relaxed objective
`F + (m - 1)(pw P + dw D)` is then searched over (P, D) with the same branch and bound as the DP
(`tessel.plan.solvers.dp._Search`): a box's knapsack gives its least sum and a relaxed plan with
bottlenecks (p, d); the rest of the box splits into {max T^pre < p} and
{max T^pre >= p, max T^dec < d}. The least bound left open, or the relaxed optimum, bounds every
real plan from below. Host limits count; the swap-in-hidden rule is dropped (a relaxation).

HiGHS's dual bound for the MILP stays far from the optimum on 16 or more devices (symmetric
devices, big-M rows); this bound is what lets `solve` prove small gaps there.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass

import numpy as np

from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import (
    FEASIBILITY_ATOL_BYTES,
    FEASIBILITY_RTOL,
    Evaluation,
    Solution,
    evaluate,
    split_offload,
)

_INF = float("inf")
GRID_RATIO = 1e-3  # bottleneck values are rounded down to powers of (1 + GRID_RATIO)
# (first, last, leaves): a middle or first stage sends inside its node, or leaves it; the last
# stage sends nothing and ends its node's share of the pipeline
ROLES = (
    (False, False, False),
    (False, False, True),
    (True, False, False),
    (True, False, True),
    (False, True, True),
    (True, True, True),
)
MAX_KNAPSACKS = 4000
PROBE_RATIOS = (1.01, 1.03, 1.1, 1.3)  # cuts on the leading bottleneck over its least, tried first
# knapsack state besides the units placed: first taken, last taken, and the current node's status
# (0 unused, 1 used with no stage leaving it yet, 2 used and left or holding the last stage)
STATES = tuple(itertools.product((0, 1), (0, 1), (0, 1, 2)))


@dataclass(frozen=True, slots=True)
class _Choice:
    value: float  # the knapsack's optimum (inf: no choice within the bounds)
    max_prefill_s: float  # max T^pre of the choice (rounded down to the grid)
    max_decode_s: float
    picks: tuple[tuple[int, int, int], ...]  # (device, role index, units) per used device


@dataclass(frozen=True, slots=True)
class CountsBound:
    bound: float  # proven lower bound on the objective of every plan (-inf: none proven)
    relaxed_optimum: bool  # the search finished: `bound` is the relaxation's optimum
    knapsacks: int
    time_s: float
    solution: Solution | None = None  # the best feasible plan met (the incumbent given, or better)
    evaluation: Evaluation | None = None


def units_alike(instance: PlanningInstance) -> bool:
    """Every unit has the same bytes and, on every device, the same times (and no move costs or
    precision choice: fix the precisions first, `PlanningInstance.fixed`)."""
    if instance.precision is not None:
        return False
    if instance.move_s is not None and instance.move_weight > 0 and np.any(instance.move_s > 0):
        return False
    arrays = (
        instance.weight_bytes,
        instance.kv_bytes,
        instance.prefill.unit_time_s,
        instance.decode.unit_time_s,
    )
    return all(np.array_equal(a, np.broadcast_to(a[:1], a.shape)) for a in arrays)


class _Relaxation:
    """Relaxed stage times and costs per (role, device, count), and the knapsack over them.

    A stage pays its device's cheapest link inside its node or, for a stage that leaves its node,
    its cheapest link to another node. Each run of same-node stages in a pipeline ends by leaving
    the node or with the last stage, so every node a plan uses has a stage of one of those two."""

    def __init__(self, instance: PlanningInstance) -> None:
        inst = instance
        U, N = inst.n_units, inst.n_devices
        self.instance = inst
        counts = np.arange(U + 1, dtype=float)  # index n = units on the device (0 = unused)
        mem = np.array([d.memory_bytes for d in inst.devices])
        host = np.array([d.host_bytes for d in inst.devices])
        bw = np.array([d.host_to_device_bytes_per_s for d in inst.devices])
        ws = np.asarray(inst.workspace_bytes, dtype=float)
        unit_bytes = float(inst.weight_bytes[0] + inst.kv_bytes[0])
        nodes = [d.node for d in inst.devices]
        same_node = np.equal.outer(nodes, nodes)
        links = {False: same_node & ~np.eye(N, dtype=bool), True: ~same_node}  # by "leaves its node"
        self.node_groups = [[j for j in range(N) if nodes[j] == node] for node in dict.fromkeys(nodes)]
        shape = (len(ROLES), N, U + 1)
        self.tp, self.td = np.full(shape, _INF), np.full(shape, _INF)
        for r, (first, last, leaves) in enumerate(ROLES):
            held = counts[None, :] * unit_bytes + ws[:, None]
            held += (inst.first_bytes if first else 0.0) + (inst.last_bytes if last else 0.0)
            off_b = np.maximum(held - mem[:, None], 0.0)
            ok = off_b <= host[:, None] * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_BYTES
            if inst.swap_in == "hidden" and first:
                ok &= off_b <= 0.0
            with np.errstate(divide="ignore", invalid="ignore"):
                off_s = np.where(off_b > 0, off_b / bw[:, None], 0.0)
            if inst.kv_restore is not None:  # evicted KV swapped or recomputed: the same split
                kv_rate = np.array([inst.kv_rate_s_per_byte(j) for j in range(N)])[:, None]
                kv_held = counts[None, :] * float(inst.kv_bytes[0])
                off_s, _ = split_offload(held, kv_held, mem[:, None], bw[:, None], kv_rate)
            for costs, out in ((inst.prefill, self.tp), (inst.decode, self.td)):
                compute = counts[None, :] * costs.unit_time_s[0][:, None]
                compute = compute + (costs.first_time_s[:, None] if first else 0.0)
                compute = compute + (costs.last_time_s[:, None] if last else 0.0)
                if last:
                    comm = np.zeros((N, 1))
                else:
                    comm = np.where(links[leaves], costs.send_s, _INF).min(axis=1)[:, None]
                if inst.overlap:
                    time_s = np.maximum(np.maximum(compute, comm), off_s)
                else:
                    time_s = compute + comm + off_s
                out[r] = np.where(ok & np.isfinite(comm), time_s, _INF)
                out[r][:, 0] = _INF  # a used device holds at least one unit
        usable = np.isfinite(self.tp) & np.isfinite(self.td)  # a zero weight times inf is no cost
        with np.errstate(invalid="ignore"):
            self.cost = np.where(usable, inst.prefill_weight * self.tp + inst.decode_weight * self.td, _INF)
        # the bottleneck terms see stage times rounded down to a geometric grid: still a lower bound,
        # and the (P, D) staircase the search walks has a bounded number of steps
        self.tp, self.td = _round_down(self.tp), _round_down(self.td)
        self.moves = [_moves(role) for role in ROLES]

    def allowed(self, hi_p: float, strict_p: bool, hi_d: float, strict_d: bool) -> np.ndarray:
        ok_p = self.tp < hi_p if strict_p else self.tp <= hi_p
        return ok_p & (self.td < hi_d if strict_d else self.td <= hi_d)

    def knapsack(self, allowed: np.ndarray, value: np.ndarray, combine) -> _Choice:
        """Best choice of (count, role) per device with all units placed, one first and one last.

        `combine` is np.add (least sum of `value`) or np.maximum (least max of `value`)."""
        U = self.instance.n_units
        value = np.where(allowed, value, _INF)
        best = np.full((U + 1, len(STATES)), _INF)
        best[0, 0] = 0.0
        max_p, max_d = np.zeros_like(best), np.zeros_like(best)
        targets = np.arange(U + 1)
        trail = []  # per device: (role, count, source state) by (t, state); per node: source state
        for group in self.node_groups:
            for j in group:
                new, new_p, new_d = best.copy(), max_p.copy(), max_d.copy()
                how = np.full((3, U + 1, len(STATES)), -1, dtype=np.int64)  # role -1: device unused
                live = np.flatnonzero(np.isfinite(best).any(axis=0))
                for r in range(len(ROLES)):
                    counts = np.flatnonzero(np.isfinite(value[r, j]))
                    if counts.size == 0:
                        continue
                    # total[i, t, k]: source state live[k] holding t - counts[i] units, plus this device
                    source = targets[None, :] - counts[:, None]
                    total = combine(
                        best[np.maximum(source, 0)][:, :, live], value[r, j, counts][:, None, None]
                    )
                    total[source < 0] = _INF
                    pick = np.argmin(total, axis=0)  # [t, k]: index into counts
                    reached = np.take_along_axis(total, pick[None], axis=0)[0]
                    for column, k in enumerate(live):
                        target = self.moves[r].get(int(k))
                        if target is None:
                            continue
                        better = reached[:, column] < new[:, target]
                        if not better.any():
                            continue
                        n = counts[pick[better, column]]
                        src = targets[better] - n
                        new[better, target] = reached[better, column]
                        new_p[better, target] = np.maximum(max_p[src, k], self.tp[r, j, n])
                        new_d[better, target] = np.maximum(max_d[src, k], self.td[r, j, n])
                        how[0, better, target] = r
                        how[1, better, target] = n
                        how[2, better, target] = k
                best, max_p, max_d = new, new_p, new_d
                trail.append(("device", j, how))
            best, max_p, max_d, closed_from = _close_node(best, max_p, max_d)
            trail.append(("node", -1, closed_from))
        done = STATES.index((1, 1, 0))
        total = float(best[U, done])
        if not np.isfinite(total):
            return _Choice(total, _INF, _INF, ())
        return _Choice(total, float(max_p[U, done]), float(max_d[U, done]), _backtrack(trail, U, done))

    def least_sum(self, box: tuple) -> _Choice:
        return self.knapsack(self.allowed(*box), self.cost, np.add)

    def least_bottlenecks(self, box: tuple) -> tuple[float, float]:
        """Lower bounds on max T^pre and max T^dec of every relaxed plan within the box's bounds."""
        allowed = self.allowed(*box)
        return (
            self.knapsack(allowed, self.tp, np.maximum).value,
            self.knapsack(allowed, self.td, np.maximum).value,
        )


def _moves(role: tuple[bool, bool, bool]) -> dict[int, int]:
    """Target state by source state of a device taking `role` (sources it cannot leave are absent)."""
    first, last, leaves = role
    moves = {}
    for k, (has_first, has_last, node) in enumerate(STATES):
        if (first and has_first) or (last and has_last):
            continue
        node_after = 2 if (leaves or last or node == 2) else 1
        moves[k] = STATES.index((has_first | first, has_last | last, node_after))
    return moves


def _close_node(best: np.ndarray, max_p: np.ndarray, max_d: np.ndarray) -> tuple:
    """At a node's end: a used node that no stage left is no plan; the next node starts unused."""
    out = np.full_like(best, _INF)
    out_p, out_d = np.zeros_like(max_p), np.zeros_like(max_d)
    closed_from = np.full(best.shape, -1, dtype=np.int64)
    for k, (has_first, has_last, node) in enumerate(STATES):
        if node == 1:
            continue
        target = STATES.index((has_first, has_last, 0))
        better = best[:, k] < out[:, target]
        out[better, target] = best[better, k]
        out_p[better, target] = max_p[better, k]
        out_d[better, target] = max_d[better, k]
        closed_from[better, target] = k
    return out, out_p, out_d, closed_from


def _backtrack(trail: list, placed: int, state: int) -> tuple[tuple[int, int, int], ...]:
    """(device, role, count) of every used device, from the knapsack's recorded decisions."""
    picks = []
    for kind, j, how in reversed(trail):
        if kind == "node":
            state = int(how[placed, state])
            continue
        role, count, source = (int(v) for v in how[:, placed, state])
        if role < 0:
            continue
        picks.append((j, role, count))
        placed, state = placed - count, source
    return tuple(reversed(picks))


def _round_down(times: np.ndarray) -> np.ndarray:
    finite = np.isfinite(times) & (times > 0)
    out = times.copy()
    steps = np.floor(np.log(times[finite]) / np.log1p(GRID_RATIO))
    out[finite] = np.minimum(np.exp(steps * np.log1p(GRID_RATIO)), times[finite])
    return out


def plan_from_picks(instance: PlanningInstance, picks) -> Solution:
    """A real pipeline for a relaxed choice: the first stage's node first and the last stage's node
    last; inside a node the first stage, then stages that stay, then those that leave, then the
    last stage. With the links the relaxation priced, it costs what the relaxation said."""
    node_of = {j: instance.devices[j].node for j, _, _ in picks}
    first = next(j for j, r, _ in picks if ROLES[r][0])
    last = next(j for j, r, _ in picks if ROLES[r][1])
    nodes = list(dict.fromkeys(node_of[j] for j, _, _ in picks))
    nodes.sort(key=lambda node: (node != node_of[first], node == node_of[last]))

    def rank(pick) -> tuple:
        j, r, _ = pick
        is_first, is_last, leaves = ROLES[r]
        return (nodes.index(node_of[j]), not is_first, is_last, leaves and not is_last)

    ordered = sorted(picks, key=rank)
    return Solution.from_counts([j for j, _, _ in ordered], [n for _, _, n in ordered])


def counts_search(
    instance: PlanningInstance,
    *,
    incumbent: Solution | None = None,
    rel_gap: float = 0.0,
    time_limit_s: float = 5.0,
    max_knapsacks: int = MAX_KNAPSACKS,
) -> CountsBound:
    """Lower bound on every plan's objective, and the best plan met on the way.

    The bottleneck of the pass whose term weighs more (A: decode when `decode_weight * max T^dec`
    leads, else prefill) is searched first, the other one (B) inside it:

    - slices: step k takes the least-sum relaxed plan with max A below the previous step's
      (a_k < a_{k-1}, sum F_k, max B p_k). Relaxed plans with max A in [a_k, a_{k-1}) cost at least
      F_k + (m - 1)(w_a a_k + w_b b_k), b_k the least max B under the slice's bound (a max-plus
      knapsack); those with max B >= p_k at least F_k + (m - 1)(w_a a_k + w_b p_k). Plans below the
      last slice cost at least F_k + (m - 1) times the global least bottlenecks.
    - inside the weakest slice: the least-sum plan with max B below the slice's cut p gives
      (F', p'); the slice's plans with max B in [p', p) cost at least F' + (m - 1)(w_a a_k + w_b p').

    Pieces whose bound reaches `(1 - rel_gap)` times the best objective known (the target) are left:
    they cannot show a larger gap. Two things keep the walk short: a few least-sum plans with max A a
    little above its least are offered first (`PROBE_RATIOS`), so the target starts near the optimum;
    and after step k the slices whose max A is so large that F_k + (m - 1)(w_a a + w_b b_glo) reaches
    the target are skipped, their bound being the target. Every relaxed plan met becomes a real
    pipeline (`plan_from_picks`) and is offered as the incumbent. Units that differ give bound -inf
    and only the incumbent given."""
    from tessel.plan.solvers.dp import bottleneck_lower_bounds

    started = time.perf_counter()
    best = _Incumbent(instance, incumbent)
    if not units_alike(instance):
        return best.result(-_INF, False, 0, started)
    search = _SliceSearch(instance, best, rel_gap, started + time_limit_s, max_knapsacks)
    lb_p, lb_d = bottleneck_lower_bounds(instance)
    bound, finished = search.run(lb_p, lb_d)
    return best.result(bound, finished, search.calls, started)


class _SliceSearch:
    def __init__(self, instance, best, rel_gap: float, deadline: float, max_knapsacks: int) -> None:
        self.instance, self.best, self.rel_gap = instance, best, rel_gap
        self.deadline, self.max_knapsacks = deadline, max_knapsacks
        self.relax = _Relaxation(instance)
        self.calls = 0
        self.seq = itertools.count()

    def out_of_budget(self) -> bool:
        return self.calls >= self.max_knapsacks or time.perf_counter() > self.deadline

    def target(self) -> float:
        return self.best.objective * (1 - self.rel_gap)

    def box(self, cut_a: float, strict_a: bool, cut_b: float, strict_b: bool) -> tuple:
        """Knapsack bounds (hi_p, strict_p, hi_d, strict_d) from cuts on A and B."""
        return (cut_b, strict_b, cut_a, strict_a) if self.lead_d else (cut_a, strict_a, cut_b, strict_b)

    def solve(self, bounds: tuple) -> tuple[_Choice, float, float]:
        """The least-sum relaxed plan within `bounds` (offered as a real plan), and its max A, max B."""
        self.calls += 1
        choice = self.relax.least_sum(bounds)
        if not np.isfinite(choice.value):
            return choice, _INF, _INF
        self.best.offer(plan_from_picks(self.instance, choice.picks))
        if self.lead_d:
            return choice, choice.max_decode_s, choice.max_prefill_s
        return choice, choice.max_prefill_s, choice.max_decode_s

    def least_b(self, bounds: tuple) -> float:
        self.calls += 1
        values = self.relax.tp if self.lead_d else self.relax.td
        return self.relax.knapsack(self.relax.allowed(*bounds), values, np.maximum).value

    def probe(self, glo_a: float) -> None:
        """Least-sum plans with max A a little above its least: balanced plans offered early, so the
        target is near the optimum while the slices are walked and `skip` passes over most of them."""
        for ratio in PROBE_RATIOS:
            if self.out_of_budget():
                return
            self.solve(self.box(glo_a * ratio, False, _INF, False))

    def run(self, lb_p: float, lb_d: float) -> tuple[float, bool]:
        inst = self.instance
        m1 = inst.micro_batches - 1
        self.lead_d = inst.decode_weight * lb_d >= inst.prefill_weight * lb_p
        w_a, w_b = (inst.decode_weight, inst.prefill_weight)
        if not self.lead_d:
            w_a, w_b = w_b, w_a
        self.calls += 2
        glo_p, glo_d = self.relax.least_bottlenecks((_INF, False, _INF, False))
        glo_a, glo_b = (max(glo_d, lb_d), max(glo_p, lb_p))
        if not self.lead_d:
            glo_a, glo_b = (max(glo_p, lb_p), max(glo_d, lb_d))
        self.probe(glo_a)
        settled = _INF  # least bound of the pieces no split will raise
        pieces: list = []  # heap: (bound, seq, cut on A, strict, a_k, cut on B, b_k)
        cut_a, strict_a = _INF, False
        skipped = False  # slices passed over: the bound is then the target, not the relaxed optimum
        remainder = m1 * (w_a * glo_a + w_b * glo_b)  # bound on the plans below the cut on A
        while True:  # slices
            if self.out_of_budget():
                return min(settled, _heap_min(pieces), remainder), False
            bounds = self.box(cut_a, strict_a, _INF, False)
            choice, a_k, p_k = self.solve(bounds)
            if not np.isfinite(choice.value):
                remainder = _INF
                break
            b_k = max(self.least_b(bounds), glo_b)
            settled = min(settled, choice.value + m1 * (w_a * a_k + w_b * p_k))
            if p_k > b_k:
                bound = choice.value + m1 * (w_a * a_k + w_b * b_k)
                heapq.heappush(pieces, (bound, next(self.seq), cut_a, strict_a, a_k, p_k, b_k))
            remainder = choice.value + m1 * (w_a * glo_a + w_b * glo_b)
            if m1 == 0 or remainder >= min(settled, self.target()):
                break
            cut_a, strict_a = a_k, True
            # every plan below the cut sums to at least choice.value, so those whose max A reaches
            # `skip` cost at least the target: skip the slices between (they cannot show a larger gap)
            skip = (self.target() - choice.value - m1 * w_b * glo_b) / (m1 * w_a) if w_a > 0 else _INF
            if skip < cut_a:
                settled = min(settled, choice.value + m1 * (w_a * skip + w_b * glo_b))
                cut_a, skipped = skip, True
        while pieces and pieces[0][0] < min(settled, self.target()) and not self.out_of_budget():
            _, _, c_a, s_a, a_k, cut_b, b_k = heapq.heappop(pieces)
            choice, _, p_new = self.solve(self.box(c_a, s_a, cut_b, True))
            if not np.isfinite(choice.value):
                continue
            settled = min(settled, choice.value + m1 * (w_a * a_k + w_b * p_new))
            if p_new > b_k:
                bound = choice.value + m1 * (w_a * a_k + w_b * b_k)
                heapq.heappush(pieces, (bound, next(self.seq), c_a, s_a, a_k, p_new, b_k))
        bound = min(settled, _heap_min(pieces), remainder)
        return bound, not pieces and not skipped and remainder >= settled


def _heap_min(pieces: list) -> float:
    return pieces[0][0] if pieces else _INF


class _Incumbent:
    """The best feasible plan seen (by `evaluate`'s objective)."""

    def __init__(self, instance: PlanningInstance, solution: Solution | None) -> None:
        self.instance = instance
        self.solution: Solution | None = None
        self.evaluation: Evaluation | None = None
        self.objective = _INF
        if solution is not None:
            self.offer(solution)

    def offer(self, solution: Solution) -> None:
        evaluation = evaluate(self.instance, solution)
        if evaluation.feasible and evaluation.objective < self.objective:
            self.solution, self.evaluation, self.objective = solution, evaluation, evaluation.objective

    def result(self, bound: float, finished: bool, calls: int, started: float) -> CountsBound:
        bound = min(bound, self.objective)  # the relaxation can never prove more than the optimum
        return CountsBound(
            bound, finished, calls, time.perf_counter() - started, self.solution, self.evaluation
        )
