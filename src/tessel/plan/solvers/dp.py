"""Exact dynamic program for a fixed device order, and a search over orders of device types.

For a fixed order of the devices (any of them may be skipped, i.e. left idle), the stages of a plan
are runs of units on an increasing subsequence of that order. With bounds `tau_p` on every
stage's prefill time and `tau_d` on its decode time, a backward DP minimises the weighted sum
`prefill_weight * sum T^pre + decode_weight * sum T^dec`:

    W[u, p, e] = least cost of units u..U-1 when the stage on order position p holds [u, e)
               = stage(p, u, e, next q) + min_f { W[e, q, f] : swap-in of q's stage [e, f) fits
                                                             under stage (p, u, e)'s work }

(host limits, both bounds and, with `swap_in="hidden"`, the swap-in rule are masks; `evaluate`'s
rules, same tolerances). With `stream_layers` a stage's streamed weights are priced as the whole
layers the runtime copies, exactly as `evaluate` does, from a table of the bytes streaming units
[s, e) frees (`_stream_table`).
The objective has two bottlenecks, max T^pre and max T^dec, so the bounds are searched as a
staircase: a row fixes tau_d, steps tighten tau_p strictly below the bottleneck of the last
optimum, the next row tightens tau_d strictly below the largest decode bottleneck of the row. Every
(tau_p, tau_d) corner where the min-sum plan changes is visited, so the best of them is optimal for
the order (proof sketch in docs/planner.md); rows and steps stop early when the sum found so far
plus (m - 1) times lower bounds on the bottlenecks cannot beat the incumbent.

Guarantee: `exact=True` means optimal over every plan whose pipeline visits devices in one of the
orders searched. With `orders="all"` (automatic for N <= 5) that is every plan. With `"types"`
the orders are permutations of device-type groups (devices of one type contiguous, sorted by node
then name inside the group): optimal among plans that keep each type's devices together in the
pipeline when same-type devices are interchangeable (a plan that leaves a type and comes back to
it, e.g. A100 -> T4 -> A100, is not searched; the MILP covers those). Beyond `MAX_TYPE_ORDERS`
permutations it falls back to a few heuristic orders (by speed, by memory) and claims nothing.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import (
    FEASIBILITY_ATOL_BYTES,
    FEASIBILITY_ATOL_S,
    FEASIBILITY_RTOL,
    Evaluation,
    Solution,
    Stage,
    evaluate,
    split_offload,
)
from tessel.plan.solvers.highs import solve_lp
from tessel.plan.solvers.precision_search import MAX_ENUMERATED, enumerate_dp, local_search
from tessel.plan.solvers.symmetry import interchangeable
from tessel.plan.streamed import STREAM_BUFFERS

MAX_TYPE_ORDERS = 120  # 5 device types: 5! orders
ALL_ORDERS_MAX_DEVICES = 5  # `orders="auto"` tries every device permutation up to this many devices
MAX_DP_CALLS = 4000
DIVE_SLACKS = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8)  # first feasible one gives a balanced incumbent
DIVE_ORDERS = 4  # orders dived into before the exact search (the heuristic type orders come first)
CACHE_ELEMENTS = 3_000_000  # per-order cache of bound-independent arrays (~35 bytes each)
_INF = float("inf")


@dataclass(frozen=True, slots=True)
class DPResult:
    solution: Solution | None
    evaluation: Evaluation | None
    exact: bool  # optimal over every plan the orders admit (complete search, rel_gap 0)
    bound: float  # proven lower bound on the objective over the orders searched (inf: none feasible)
    orders_searched: int
    orders_total: int
    dp_calls: int
    time_s: float


@dataclass(frozen=True, slots=True)
class _Path:
    cost: float  # pw * sum T^pre + dw * sum T^dec (+ weighted move cost when re-planning)
    max_prefill_s: float
    max_decode_s: float
    stages: tuple[Stage, ...]


class _OrderDP:
    """Arrays of one device order, and the bounded min-sum DP over them.

    Everything that does not depend on the bounds (stage times, which successor ranges the swap-in
    rule admits) is computed once per order and kept when it fits `CACHE_ELEMENTS`."""

    def __init__(self, instance: PlanningInstance, order: tuple[int, ...], stream=None) -> None:
        self.instance = instance
        self.stream = (stream or _stream_table(instance)) if instance.stream_layers else None
        self.order = np.asarray(order, dtype=int)
        idx = self.order
        n, U = len(order), instance.n_units
        zero = np.zeros((n, 1))
        self.cum_p = np.concatenate([zero, np.cumsum(instance.prefill.unit_time_s.T[idx], axis=1)], axis=1)
        self.cum_d = np.concatenate([zero, np.cumsum(instance.decode.unit_time_s.T[idx], axis=1)], axis=1)
        self.first_p, self.last_p = instance.prefill.first_time_s[idx], instance.prefill.last_time_s[idx]
        self.first_d, self.last_d = instance.decode.first_time_s[idx], instance.decode.last_time_s[idx]
        self.send_p = instance.prefill.send_s[np.ix_(idx, idx)]
        self.send_d = instance.decode.send_s[np.ix_(idx, idx)]
        self.cum_bytes = np.concatenate([[0.0], np.cumsum(instance.weight_bytes + instance.kv_bytes)])
        self.cum_kv = np.concatenate([[0.0], np.cumsum(instance.kv_bytes)])
        move = np.zeros((U, n)) if instance.move_s is None else instance.move_s[:, idx] * instance.move_weight
        self.cum_move = np.concatenate([zero, np.cumsum(move.T, axis=1)], axis=1)  # weighted, per order slot
        devices = [instance.devices[j] for j in order]
        self.mem = np.array([d.memory_bytes for d in devices], dtype=float)
        self.host = np.array([d.host_bytes for d in devices], dtype=float)
        self.bw = np.array([d.host_to_device_bytes_per_s for d in devices], dtype=float)
        self.shared = np.array([d.copies_share_compute for d in devices], dtype=bool)
        kv_rates = [instance.kv_rate_s_per_byte(j) for j in order]
        self.kv_rate = None if instance.kv_restore is None else np.array(kv_rates, dtype=float)
        self.ws = np.asarray(instance.workspace_bytes, dtype=float)[idx]
        self.later = np.arange(n)[None, None, :] > np.arange(n)[:, None, None]  # [p, 1, q]: q after p
        self.size = (U + 1) * n * (U + 1)  # flat W / prefix-min arrays; index `size` is an inf sentinel
        self.cache: dict[int, tuple] | None = {} if n * n * U * U // 2 <= CACHE_ELEMENTS else None
        self.first_ok: np.ndarray | None = None

    def _flat(self, e, q, f):
        U1 = self.instance.n_units + 1
        return (e * len(self.order) + q) * U1 + f

    def _combine(self, compute, comm, offload, shared):
        """`evaluate`'s T_j; `shared` (per stage device): copies take the compute's cores."""
        if not self.instance.overlap:
            return compute + comm + offload
        apart = np.maximum(np.maximum(compute, comm), offload)
        return np.where(shared, np.maximum(compute + offload, comm), apart) if self.shared.any() else apart

    def _streamed_s(self, u: int, es: np.ndarray, streamed: np.ndarray) -> np.ndarray:
        """Seconds to copy in the whole layers that stream `streamed` bytes ([device, e]) of stages
        [u, e): the fewest last layers whose streaming frees them (`tessel.plan.streamed`)."""
        freed, starts, cum_w = self.stream
        U = self.instance.n_units
        seconds = np.zeros_like(streamed)
        dev, col = np.nonzero(streamed > 0)
        if dev.size == 0:
            return seconds
        e, need = es[col], streamed[dev, col]
        candidate = starts[u:U].copy()
        candidate[0] = True  # the stage's first unit starts its first piece
        ok = (freed[u:U][:, e] >= need[None, :]) & candidate[:, None]
        last = (U - u - 1) - np.argmax(ok[::-1], axis=0)
        s = np.where(ok.any(axis=0), u + last, u)
        copied = cum_w[e] - cum_w[s] + np.maximum(need - freed[s, e], 0.0)
        bw = self.bw[dev]
        with np.errstate(divide="ignore", invalid="ignore"):
            seconds[dev, col] = np.where(bw > 0, copied / bw, _INF)
        return seconds

    def _layer(self, u: int) -> tuple:
        """Bound-independent arrays for stages that start at unit u."""
        if self.cache is not None and u in self.cache:
            return self.cache[u]
        inst = self.instance
        U, n = inst.n_units, len(self.order)
        cb = self.cum_bytes
        es = np.arange(u + 1, U + 1)
        comp_p = self.cum_p[:, es] - self.cum_p[:, u : u + 1]
        comp_d = self.cum_d[:, es] - self.cum_d[:, u : u + 1]
        held = (cb[es] - cb[u])[None, :] + self.ws[:, None]
        if u == 0:
            comp_p = comp_p + self.first_p[:, None]
            comp_d = comp_d + self.first_d[:, None]
            held = held + inst.first_bytes
        comp_p[:, -1] += self.last_p
        comp_d[:, -1] += self.last_d
        held[:, -1] += inst.last_bytes
        off_b = np.maximum(held - self.mem[:, None], 0.0)
        host_ok = off_b <= self.host[:, None] * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_BYTES
        with np.errstate(divide="ignore", invalid="ignore"):
            off_s = np.where(off_b > 0, off_b / self.bw[:, None], 0.0)
        evicted = np.zeros_like(off_b)
        if self.kv_rate is not None:  # evicted KV swapped or recomputed (hidden swap-in excluded)
            kv = (self.cum_kv[es] - self.cum_kv[u])[None, :]
            rates = self.kv_rate[:, None]
            off_s, evicted = split_offload(held, kv, self.mem[:, None], self.bw[:, None], rates)
        if self.stream is not None:  # whole streamed layers (evicted KV priced as above)
            kv_s = 0.0 if self.kv_rate is None else evicted * self.kv_rate[:, None]
            off_s = self._streamed_s(u, es, off_b - evicted) + kv_s
        if u == 0:
            self.first_ok = off_b <= 0.0 if inst.swap_in == "hidden" else np.ones_like(host_ok)
        move = self.cum_move[:, es] - self.cum_move[:, u : u + 1]
        # last stage (e == U)
        tp_last = self._combine(comp_p[:, -1], 0.0, off_s[:, -1], self.shared)
        td_last = self._combine(comp_d[:, -1], 0.0, off_s[:, -1], self.shared)
        last = (tp_last, td_last, host_ok[:, -1], move[:, -1])
        inner = None
        if u < U - 1:
            es = es[:-1]
            cp, cd, off = comp_p[:, :-1, None], comp_d[:, :-1, None], off_s[:, :-1, None]
            sp, sd = self.send_p[:, None, :], self.send_d[:, None, :]
            shared = self.shared[:, None, None]
            tp, td = self._combine(cp, sp, off, shared), self._combine(cd, sd, off, shared)
            if inst.swap_in == "hidden":
                threshold = np.minimum(cp + sp, cd + sd) * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_S
                allowance = threshold * self.bw[None, None, :]  # bytes q may stream in under stage p
            else:
                allowance = np.full((n, 1, n), _INF)  # only q's own host limit (its mask) applies
            e3 = es[None, :, None]
            q3 = np.arange(n)[None, None, :]
            # successor [e, f) with f < U: held - mem <= allowance  <=>  cum_bytes[f] <= limit
            limit = cb[e3] - self.ws[None, None, :] + self.mem[None, None, :] + allowance
            f_max = np.minimum(np.searchsorted(cb, limit, side="right") - 1, U - 1)
            via_prefix = np.where(f_max >= e3 + 1, self._flat(e3, q3, f_max), self.size)
            # successor [e, U): also holds last_bytes
            held_last = (cb[U] - cb[es])[:, None] + self.ws[None, :] + inst.last_bytes
            over_last = np.maximum(held_last - self.mem[None, :], 0.0)[None, :, :]
            via_last = np.where(over_last <= allowance, self._flat(e3, q3, U), self.size)
            ok = self.later & host_ok[:, :-1, None]
            base = inst.prefill_weight * tp + inst.decode_weight * td + move[:, :-1, None]
            inner = (tp, td, base, via_prefix, via_last, ok)
        result = (last, inner)
        if self.cache is not None:
            self.cache[u] = result
        return result

    def run(self, bound_p: float, strict_p: bool, bound_d: float, strict_d: bool) -> _Path | None:
        inst = self.instance
        U, n = inst.n_units, len(self.order)
        pw, dw = inst.prefill_weight, inst.decode_weight

        def within(t, bound, strict):
            return t < bound if strict else t <= bound

        W = np.full(self.size + 1, _INF)
        pmin = np.full(self.size + 1, _INF)
        parg = np.zeros(self.size + 1, dtype=np.int64)
        next_flat = np.zeros(self.size, dtype=np.int64)  # flat (e, q, f) of the successor stage
        t_pre = np.zeros(self.size)
        t_dec = np.zeros(self.size)
        W3 = W[: self.size].reshape(U + 1, n, U + 1)
        pmin3 = pmin[: self.size].reshape(U + 1, n, U + 1)
        parg3 = parg[: self.size].reshape(U + 1, n, U + 1)
        for u in range(U - 1, -1, -1):
            (tp_last, td_last, host_last, move_last), inner = self._layer(u)
            ok = host_last & within(tp_last, bound_p, strict_p) & within(td_last, bound_d, strict_d)
            W3[u, :, U] = np.where(ok, pw * tp_last + dw * td_last + move_last, _INF)
            at = self._flat(u, np.arange(n), U)
            t_pre[at], t_dec[at] = tp_last, td_last
            if inner is None:
                continue
            tp, td, base, via_prefix, via_last, static_ok = inner
            v1, v2 = pmin[via_prefix], W[via_last]
            succ = np.where(v1 <= v2, parg[via_prefix], via_last)
            value = np.minimum(v1, v2)
            ok = static_ok
            if bound_p < _INF:
                ok = ok & within(tp, bound_p, strict_p)
            if bound_d < _INF:
                ok = ok & within(td, bound_d, strict_d)
            cand = np.where(ok, base + value, _INF)
            n_e = U - 1 - u
            chosen = (np.arange(n * n_e) * n + np.argmin(cand, axis=2).reshape(-1)).reshape(n, n_e)
            W3[u, :, u + 1 : U] = cand.reshape(-1)[chosen]
            rows = self._flat(u, np.arange(n)[:, None], np.arange(u + 1, U)[None, :])
            next_flat[rows] = succ.reshape(-1)[chosen]
            t_pre[rows] = tp.reshape(-1)[chosen]
            t_dec[rows] = td.reshape(-1)[chosen]
            row = W3[u, :, u + 1 : U]
            acc = np.minimum.accumulate(row, axis=1)
            prev = np.concatenate([np.full((n, 1), _INF), acc[:, :-1]], axis=1)
            pmin3[u, :, u + 1 : U] = acc
            parg3[u, :, u + 1 : U] = np.maximum.accumulate(np.where(row < prev, rows, -1), axis=1)
        start = np.where(self.first_ok, W3[0, :, 1:], _INF)
        if not np.isfinite(start).any():
            return None
        p, e_off = np.unravel_index(int(np.argmin(start)), start.shape)
        cost = float(start[p, e_off])
        at = int(self._flat(0, int(p), int(e_off) + 1))
        stages = []
        max_p = max_d = 0.0
        while True:
            rest, f = divmod(at, U + 1)
            u, q = divmod(rest, n)
            stages.append(Stage(int(self.order[q]), u, f))
            max_p, max_d = max(max_p, t_pre[at]), max(max_d, t_dec[at])
            if f == U:
                break
            at = int(next_flat[at])
        return _Path(cost, float(max_p), float(max_d), tuple(stages))


def _stream_table(instance: PlanningInstance) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(freed[s, e]: device bytes freed by streaming units [s, e), grouped by decoder layer, as
    `tessel.plan.streamed.freed_bytes` counts them (-inf where s >= e); starts[s]: unit s starts a
    layer; cumulative weight bytes)."""
    U = instance.n_units
    w = np.asarray(instance.weight_bytes, dtype=float)
    layer = [unit.layer for unit in instance.units]
    freed = np.full((U + 1, U + 1), -_INF)
    for e in range(1, U + 1):
        done: list[float] = []  # the largest STREAM_BUFFERS whole pieces after the first, descending
        first = total = 0.0
        for s in range(e - 1, -1, -1):
            if s < e - 1 and layer[s] != layer[s + 1]:  # the piece at s + 1 is complete
                done = sorted([*done, first], reverse=True)[:STREAM_BUFFERS]
                first = 0.0
            first += float(w[s])
            total += float(w[s])
            freed[s, e] = total - sum(sorted([*done, first], reverse=True)[:STREAM_BUFFERS])
    starts = np.array([s == 0 or layer[s] != layer[s - 1] for s in range(U)] + [False])
    return freed, starts, np.concatenate([[0.0], np.cumsum(w)])


def bottleneck_lower_bounds(instance: PlanningInstance) -> tuple[float, float]:
    """Lower bounds on max_j T_j^pre and max_j T_j^dec of any plan.

    Each is the larger of the slowest unit on its fastest device and the LP bound
    min tau s.t. every unit is split fractionally over devices and no device works longer than tau."""
    bounds = []
    for costs in (instance.prefill, instance.decode):
        times = np.asarray(costs.unit_time_s, dtype=float)
        single = float(times.min(axis=1).max())
        bounds.append(max(single, _fractional_makespan(times)))
    return bounds[0], bounds[1]


def _fractional_makespan(times: np.ndarray) -> float:
    """min tau s.t. sum_j x[u, j] = 1, sum_u times[u, j] x[u, j] <= tau, x >= 0 (HiGHS LP)."""
    U, N = times.shape
    n_x = U * N
    cost = np.zeros(n_x + 1)
    cost[-1] = 1.0
    u_idx, j_idx = np.divmod(np.arange(n_x), N)
    rows = np.concatenate([u_idx, U + j_idx, U + np.arange(N)])
    cols = np.concatenate([np.arange(n_x), np.arange(n_x), np.full(N, n_x)])
    vals = np.concatenate([np.ones(n_x), times.reshape(-1), -np.ones(N)])
    lower = np.concatenate([np.ones(U), np.full(N, -np.inf)])
    upper = np.concatenate([np.ones(U), np.zeros(N)])
    value = solve_lp(cost, np.zeros(n_x + 1), np.full(n_x + 1, np.inf), rows, cols, vals, lower, upper)
    return 0.0 if value is None else value * (1 - 1e-9)


def _path_objective(instance: PlanningInstance, path: _Path) -> float:
    m1 = instance.micro_batches - 1
    return path.cost + m1 * (
        instance.prefill_weight * path.max_prefill_s + instance.decode_weight * path.max_decode_s
    )


@dataclass(order=True)
class _Box:
    """Plans with lo_p <= max T^pre (< or <=) hi_p and lo_d <= max T^dec (< or <=) hi_d."""

    bound: float  # lower bound on the objective of any plan in the box
    seq: int
    hi_p: float = field(compare=False)
    strict_p: bool = field(compare=False)
    hi_d: float = field(compare=False)
    strict_d: bool = field(compare=False)
    lo_p: float = field(compare=False)
    lo_d: float = field(compare=False)

    def empty(self) -> bool:
        return (
            self.hi_p < self.lo_p
            or self.hi_d < self.lo_d
            or ((self.strict_p and self.hi_p <= self.lo_p) or (self.strict_d and self.hi_d <= self.lo_d))
        )


class _Search:
    """Branch and bound over boxes of (max T^pre, max T^dec), one DP per box, shared incumbent.

    Solving a box's DP with its upper bounds gives the least sum F over the box and a plan x with
    bottlenecks (P, D). Every plan of the box with max T^pre >= P and max T^dec >= D costs at least
    obj(x), so the rest splits into {max T^pre < P} and {max T^pre >= P, max T^dec < D}; both
    children inherit F as a lower bound on their sums."""

    def __init__(self, instance: PlanningInstance, deadline: float, max_calls: int, rel_gap: float) -> None:
        self.instance = instance
        self.deadline = deadline
        self.max_calls = max_calls
        self.rel_gap = rel_gap
        self.calls = 0
        self.best: _Path | None = None
        self.best_obj = _INF
        self.lb_p, self.lb_d = bottleneck_lower_bounds(instance)
        self.stream = _stream_table(instance) if instance.stream_layers else None
        self.open_bound = _INF  # least lower bound left unexplored (over all orders searched)
        self.last_run_s = 0.0  # a DP pass cannot stop halfway: the next is started only if it can end in time
        self._seq = itertools.count()

    def _box_bound(self, sum_lb: float, lo_p: float, lo_d: float) -> float:
        inst = self.instance
        m1 = inst.micro_batches - 1
        return sum_lb + m1 * (inst.prefill_weight * lo_p + inst.decode_weight * lo_d)

    def _prunable(self, bound: float) -> bool:
        return bound >= self.best_obj - self.rel_gap * abs(self.best_obj) - 1e-12 * abs(self.best_obj)

    def out_of_budget(self) -> bool:
        return self.calls >= self.max_calls or time.perf_counter() + self.last_run_s > self.deadline

    def run(self, dp: _OrderDP, bound_p: float, strict_p: bool, bound_d: float, strict_d: bool):
        started = time.perf_counter()
        self.calls += 1
        path = dp.run(bound_p, strict_p, bound_d, strict_d)
        self.last_run_s = time.perf_counter() - started
        return path

    def dive(self, order: tuple[int, ...]) -> None:
        """Quick incumbents: both bottlenecks bounded a little above their lower bounds."""
        dp = _OrderDP(self.instance, order, self.stream)
        for slack in DIVE_SLACKS:
            if self.out_of_budget():
                return
            path = self.run(dp, self.lb_p * (1 + slack), False, self.lb_d * (1 + slack), False)
            if path is not None:
                obj = _path_objective(self.instance, path)
                if obj < self.best_obj:
                    self.best, self.best_obj = path, obj
                return

    def search(self, order: tuple[int, ...]) -> None:
        inst = self.instance
        dp = _OrderDP(inst, order, self.stream)
        m1 = inst.micro_batches - 1
        queue = [
            _Box(
                self._box_bound(0.0, self.lb_p, self.lb_d),
                next(self._seq),
                _INF,
                False,
                _INF,
                False,
                self.lb_p,
                self.lb_d,
            )
        ]
        while queue:
            box = heapq.heappop(queue)
            if self._prunable(box.bound):
                continue
            if self.out_of_budget():
                self.open_bound = min(self.open_bound, box.bound)
                return
            path = self.run(dp, box.hi_p, box.strict_p, box.hi_d, box.strict_d)
            if path is None:
                continue
            obj = _path_objective(inst, path)
            if obj < self.best_obj:
                self.best, self.best_obj = path, obj
            if m1 == 0:
                continue  # no bottleneck term: the least-sum plan is optimal for the order
            p, d = path.max_prefill_s, path.max_decode_s
            children = []
            if inst.prefill_weight > 0:
                children.append(_Box(0.0, 0, p, True, box.hi_d, box.strict_d, box.lo_p, box.lo_d))
            if inst.decode_weight > 0:
                lo_p = max(box.lo_p, p) if inst.prefill_weight > 0 else box.lo_p
                children.append(_Box(0.0, 0, box.hi_p, box.strict_p, d, True, lo_p, box.lo_d))
            for child in children:
                child.bound = self._box_bound(path.cost, child.lo_p, child.lo_d)
                child.seq = next(self._seq)
                if not child.empty() and not self._prunable(child.bound):
                    heapq.heappush(queue, child)
        return


def device_orders(instance: PlanningInstance, orders: str = "auto") -> tuple[list[tuple[int, ...]], bool]:
    """Device orders to search, and whether they are all type-group permutations (no fallback)."""
    n = instance.n_devices
    if orders == "auto":
        orders = "all" if n <= ALL_ORDERS_MAX_DEVICES else "types"
    if orders == "all":
        signature = [_device_signature(instance, j) for j in range(n)]
        seen, result = set(), []
        for perm in itertools.permutations(range(n)):
            key = tuple(signature[j] for j in perm)
            if key not in seen:
                seen.add(key)
                result.append(perm)
        return result, True
    if orders != "types":
        raise ValueError(f"orders must be 'auto', 'all' or 'types', got {orders!r}")
    groups: dict[str, list[int]] = {}
    for j, device in enumerate(instance.devices):
        groups.setdefault(device.gpu_type, []).append(j)
    for members in groups.values():
        members.sort(key=lambda j: (instance.devices[j].node, instance.devices[j].name))
    names = list(groups)
    speed = {t: -float(instance.decode.unit_time_s[:, groups[t]].mean()) for t in names}
    memory = {t: instance.devices[groups[t][0]].memory_bytes for t in names}
    heuristic = [
        sorted(names, key=lambda t: -speed[t]),  # fastest first
        sorted(names, key=lambda t: -memory[t]),  # most memory first
        sorted(names, key=lambda t: speed[t]),
        sorted(names, key=lambda t: memory[t]),
    ]
    if math.factorial(len(names)) <= MAX_TYPE_ORDERS:
        type_orders = heuristic + list(itertools.permutations(names))
        complete = True
    else:
        type_orders, complete = heuristic, False
    result, seen = [], set()
    for type_order in type_orders:
        key = tuple(type_order)
        if key not in seen:
            seen.add(key)
            result.append(tuple(j for t in type_order for j in groups[t]))
    return result, complete


def _device_signature(instance: PlanningInstance, j: int) -> tuple:
    """Devices with equal signatures are interchangeable only if links agree too; keep names apart
    unless every per-device number and every link to third devices matches."""
    d = instance.devices[j]
    for k in range(instance.n_devices):
        if k == j:
            continue
        other = instance.devices[k]
        if interchangeable(instance, j, k) and (other.name < d.name):
            return _device_signature(instance, k)
    return (d.name,)


def solve_dp(
    instance: PlanningInstance,
    *,
    orders: str = "auto",
    time_limit_s: float = 60.0,
    rel_gap: float = 0.0,
    max_dp_calls: int = MAX_DP_CALLS,
) -> DPResult:
    """Best plan over the device orders of `orders` (see the module docstring for the guarantee).

    `rel_gap` > 0 stops the bound search once no box can improve the incumbent by more than that
    fraction; `bound` in the result is then a proven lower bound over the orders searched."""
    if instance.precision is not None:
        return solve_dp_precisions(instance, orders=orders, time_limit_s=time_limit_s, rel_gap=rel_gap)
    started = time.perf_counter()
    order_list, complete_orders = device_orders(instance, orders)
    search = _Search(instance, started + time_limit_s, max_dp_calls, rel_gap)
    if instance.micro_batches > 1:
        for order in order_list[:DIVE_ORDERS]:
            search.dive(order)
    searched = 0
    for order in order_list:
        if search.out_of_budget():
            search.open_bound = min(search.open_bound, search._box_bound(0.0, search.lb_p, search.lb_d))
            break
        search.search(order)
        searched += 1
    elapsed = time.perf_counter() - started
    finished = searched == len(order_list) and search.open_bound == _INF
    exact = finished and complete_orders and rel_gap == 0.0
    bound = min(search.best_obj, search.open_bound)
    if finished:
        bound = search.best_obj * (1 - rel_gap) if search.best is not None else _INF
    if search.best is None:
        return DPResult(None, None, exact, bound, searched, len(order_list), search.calls, elapsed)
    solution = Solution(search.best.stages)
    return DPResult(
        solution, evaluate(instance, solution), exact, bound, searched, len(order_list), search.calls, elapsed
    )


def solve_dp_precisions(instance: PlanningInstance, *, orders: str, time_limit_s: float, rel_gap: float):
    """`solve_dp` for an instance with a precision choice (a `DPResult`)."""
    started = time.perf_counter()
    calls = [0]

    def solve_fixed(fixed: PlanningInstance, seconds: float):
        result = solve_dp(fixed, orders=orders, time_limit_s=seconds, rel_gap=rel_gap)
        calls[0] += result.dp_calls
        return result.solution, result.bound, result.exact

    if instance.n_precisions**instance.n_units <= MAX_ENUMERATED:
        search = enumerate_dp(instance, solve_fixed, time_limit_s)
    else:
        search = local_search(instance, lambda fixed, s: solve_fixed(fixed, s)[:2], time_limit_s)
    exact = search.exact and rel_gap == 0.0
    return DPResult(
        search.solution,
        search.evaluation,
        exact,
        search.bound,
        search.vectors,
        search.vectors,
        calls[0],
        time.perf_counter() - started,
    )
