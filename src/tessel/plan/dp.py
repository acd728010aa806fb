"""Exact dynamic program for a fixed device order, and a search over orders of device types.

For a fixed order of the devices (any of them may be skipped, i.e. left idle), the stages of a plan
are runs of units on an increasing subsequence of that order. With bounds `tau_p` on every
stage's prefill time and `tau_d` on its decode time, a backward DP minimises the weighted sum
`prefill_weight * sum T^pre + decode_weight * sum T^dec`:

    W[u, p, e] = least cost of units u..U-1 when the stage on order position p holds [u, e)
               = stage(p, u, e, next q) + min_f { W[e, q, f] : swap-in of q's stage [e, f) fits
                                                             under stage (p, u, e)'s work }

(the swap-in rule, host limits and both bounds are masks; `evaluate`'s rules, same tolerances).
The objective has two bottlenecks, max T^pre and max T^dec, so the bounds are searched as a
staircase: a row fixes tau_d, steps tighten tau_p strictly below the bottleneck of the last
optimum, the next row tightens tau_d strictly below the largest decode bottleneck of the row. Every
(tau_p, tau_d) corner where the min-sum plan changes is visited, so the best of them is optimal for
the order (proof sketch in docs/planner.md); rows and steps stop early when the sum found so far
plus (m - 1) times lower bounds on the bottlenecks cannot beat the incumbent.

Guarantee: `exact=True` means optimal over every plan whose pipeline visits devices in one of the
orders searched. With `orders="all"` (automatic for N <= 5) that is every plan; with `"types"`
the orders are permutations of device-type groups (devices of one type contiguous, sorted by node
then name inside the group), exact when same-type devices are interchangeable; over
`MAX_TYPE_ORDERS` permutations it falls back to a few heuristic orders (by speed, by memory).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

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
)

MAX_TYPE_ORDERS = 120  # 5 device types: 5! orders
ALL_ORDERS_MAX_DEVICES = 5  # `orders="auto"` tries every device permutation up to this many devices
MAX_DP_CALLS = 4000
_INF = float("inf")


@dataclass(frozen=True, slots=True)
class DPResult:
    solution: Solution | None
    evaluation: Evaluation | None
    exact: bool  # optimal over the orders searched (no call cap or time limit hit)
    orders_searched: int
    orders_total: int
    dp_calls: int
    time_s: float


@dataclass(frozen=True, slots=True)
class _Path:
    cost: float  # pw * sum T^pre + dw * sum T^dec
    max_prefill_s: float
    max_decode_s: float
    stages: tuple[Stage, ...]


class _OrderDP:
    """Arrays of one device order, and the bounded min-sum DP over them."""

    def __init__(self, instance: PlanningInstance, order: tuple[int, ...]) -> None:
        self.instance = instance
        self.order = np.asarray(order, dtype=int)
        idx = self.order
        zero = np.zeros((len(order), 1))
        self.cum_p = np.concatenate([zero, np.cumsum(instance.prefill.unit_time_s.T[idx], axis=1)], axis=1)
        self.cum_d = np.concatenate([zero, np.cumsum(instance.decode.unit_time_s.T[idx], axis=1)], axis=1)
        self.first_p, self.last_p = instance.prefill.first_time_s[idx], instance.prefill.last_time_s[idx]
        self.first_d, self.last_d = instance.decode.first_time_s[idx], instance.decode.last_time_s[idx]
        self.send_p = instance.prefill.send_s[np.ix_(idx, idx)]
        self.send_d = instance.decode.send_s[np.ix_(idx, idx)]
        self.cum_bytes = np.concatenate([[0.0], np.cumsum(instance.weight_bytes + instance.kv_bytes)])
        devices = [instance.devices[j] for j in order]
        self.mem = np.array([d.memory_bytes for d in devices], dtype=float)
        self.host = np.array([d.host_bytes for d in devices], dtype=float)
        self.bw = np.array([d.host_to_device_bytes_per_s for d in devices], dtype=float)
        self.ws = np.asarray(instance.workspace_bytes, dtype=float)[idx]
        n = len(order)
        self.later = np.arange(n)[None, None, :] > np.arange(n)[:, None, None]  # [p, 1, q]: q after p

    def _combine(self, compute, comm, offload):
        if self.instance.overlap:
            return np.maximum(np.maximum(compute, comm), offload)
        return compute + comm + offload

    def run(self, bound_p: float, strict_p: bool, bound_d: float, strict_d: bool) -> _Path | None:
        inst = self.instance
        U, n = inst.n_units, len(self.order)
        pw, dw = inst.prefill_weight, inst.decode_weight

        def within(t, bound, strict):
            return t < bound if strict else t <= bound

        W = np.full((U + 1, n, U + 1), _INF)
        pmin = np.full((U + 1, n, U + 1), _INF)
        parg = np.zeros((U + 1, n, U + 1), dtype=np.int64)
        next_q = np.zeros((U + 1, n, U + 1), dtype=np.int64)
        next_f = np.zeros((U + 1, n, U + 1), dtype=np.int64)
        t_pre = np.zeros((U + 1, n, U + 1))
        t_dec = np.zeros((U + 1, n, U + 1))
        first_no_offload = None
        cb = self.cum_bytes
        q_idx = np.arange(n)[None, None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            for u in range(U - 1, -1, -1):
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
                off_s = np.where(off_b > 0, off_b / self.bw[:, None], 0.0)
                if u == 0:
                    first_no_offload = off_b <= 0.0
                # last stage: e == U
                tp = self._combine(comp_p[:, -1], 0.0, off_s[:, -1])
                td = self._combine(comp_d[:, -1], 0.0, off_s[:, -1])
                ok = host_ok[:, -1] & within(tp, bound_p, strict_p) & within(td, bound_d, strict_d)
                W[u, :, U] = np.where(ok, pw * tp + dw * td, _INF)
                t_pre[u, :, U], t_dec[u, :, U] = tp, td
                if u < U - 1:
                    self._inner(u, W, pmin, parg, next_q, next_f, t_pre, t_dec, comp_p, comp_d, off_s, host_ok,
                                (bound_p, strict_p, bound_d, strict_d), q_idx, within)
                    row = W[u, :, u + 1 : U]
                    acc = np.minimum.accumulate(row, axis=1)
                    prev = np.concatenate([np.full((n, 1), _INF), acc[:, :-1]], axis=1)
                    cols = np.arange(u + 1, U)[None, :]
                    pmin[u, :, u + 1 : U] = acc
                    parg[u, :, u + 1 : U] = np.maximum.accumulate(np.where(row < prev, cols, -1), axis=1)
        start = np.where(first_no_offload, W[0, :, 1:], _INF)
        if not np.isfinite(start).any():
            return None
        p, e_off = np.unravel_index(int(np.argmin(start)), start.shape)
        e = int(e_off) + 1
        cost = float(start[p, e_off])
        stages, u, p = [], 0, int(p)
        max_p = max_d = 0.0
        while True:
            stages.append(Stage(int(self.order[p]), u, e))
            max_p, max_d = max(max_p, t_pre[u, p, e]), max(max_d, t_dec[u, p, e])
            if e == U:
                break
            u, p, e = e, int(next_q[u, p, e]), int(next_f[u, p, e])
        return _Path(cost, float(max_p), float(max_d), tuple(stages))

    def _inner(self, u, W, pmin, parg, next_q, next_f, t_pre, t_dec, comp_p, comp_d, off_s, host_ok, bounds,
               q_idx, within):
        """Stages [u, e) with e < U followed by a stage on a later order position q."""
        inst = self.instance
        U = inst.n_units
        bound_p, strict_p, bound_d, strict_d = bounds
        cb = self.cum_bytes
        es = np.arange(u + 1, U)  # e values of non-last stages
        cp, cd, off = comp_p[:, :-1, None], comp_d[:, :-1, None], off_s[:, :-1, None]
        sp, sd = self.send_p[:, None, :], self.send_d[:, None, :]
        tp = self._combine(cp, sp, off)
        td = self._combine(cd, sd, off)
        threshold = np.minimum(cp + sp, cd + sd) * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_S
        allowance = threshold * self.bw[None, None, :]  # offloaded bytes q may stream in under stage p
        e3 = es[None, :, None]
        # f < U: held(q, e, f) - mem[q] <= allowance  <=>  cum_bytes[f] <= limit
        limit = cb[e3] - self.ws[None, None, :] + self.mem[None, None, :] + allowance
        f_max = np.minimum(np.searchsorted(cb, limit, side="right") - 1, U - 1)
        valid = f_max >= e3 + 1
        f_safe = np.where(valid, f_max, 0)
        e_b = np.broadcast_to(e3, f_safe.shape)
        q_b = np.broadcast_to(q_idx, f_safe.shape)
        v1 = np.where(valid, pmin[e_b, q_b, f_safe], _INF)
        a1 = parg[e_b, q_b, f_safe]
        # f == U: q is the last stage and also holds last_bytes
        held_last = (cb[U] - cb[es])[:, None] + self.ws[None, :] + inst.last_bytes  # [e, q]
        over_last = np.maximum(held_last - self.mem[None, :], 0.0)[None, :, :]
        v2 = np.where(over_last <= allowance, W[e_b, q_b, U], _INF)
        value = np.minimum(v1, v2)
        f_choice = np.where(v1 <= v2, a1, U)
        ok = (
            self.later
            & host_ok[:, :-1, None]
            & within(tp, bound_p, strict_p)
            & within(td, bound_d, strict_d)
        )
        cand = np.where(ok, inst.prefill_weight * tp + inst.decode_weight * td + value, _INF)
        best_q = np.argmin(cand, axis=2)
        take = lambda a: np.take_along_axis(a, best_q[:, :, None], axis=2)[:, :, 0]
        W[u, :, u + 1 : U] = take(cand)
        next_q[u, :, u + 1 : U] = best_q
        next_f[u, :, u + 1 : U] = take(f_choice)
        t_pre[u, :, u + 1 : U] = take(np.broadcast_to(tp, cand.shape))
        t_dec[u, :, u + 1 : U] = take(np.broadcast_to(td, cand.shape))


def bottleneck_lower_bounds(instance: PlanningInstance) -> tuple[float, float]:
    """Lower bounds on max_j T_j^pre and max_j T_j^dec of any plan."""
    bounds = []
    for costs in (instance.prefill, instance.decode):
        fastest = costs.unit_time_s.min(axis=1)
        stages = min(instance.n_units, instance.n_devices)
        bounds.append(max(float(fastest.max()), float(fastest.sum()) / stages))
    return bounds[0], bounds[1]


def _path_objective(instance: PlanningInstance, path: _Path) -> float:
    m1 = instance.micro_batches - 1
    return path.cost + m1 * (instance.prefill_weight * path.max_prefill_s + instance.decode_weight * path.max_decode_s)


class _Search:
    """The bound staircase over one or more orders, sharing one incumbent."""

    def __init__(self, instance: PlanningInstance, deadline: float, max_calls: int) -> None:
        self.instance = instance
        self.deadline = deadline
        self.max_calls = max_calls
        self.calls = 0
        self.best: _Path | None = None
        self.best_obj = _INF
        self.complete = True
        self.lb_p, self.lb_d = bottleneck_lower_bounds(instance)

    def _budget_left(self) -> bool:
        if self.calls >= self.max_calls or time.perf_counter() > self.deadline:
            self.complete = False
            return False
        return True

    def _run(self, dp: _OrderDP, bp, sp, bd, sd) -> _Path | None:
        self.calls += 1
        path = dp.run(bp, sp, bd, sd)
        if path is not None:
            obj = _path_objective(self.instance, path)
            if obj < self.best_obj:
                self.best, self.best_obj = path, obj
        return path

    def search(self, order: tuple[int, ...]) -> None:
        inst = self.instance
        dp = _OrderDP(inst, order)
        m1 = inst.micro_batches - 1
        pw, dw = inst.prefill_weight, inst.decode_weight
        if not self._budget_left():
            return
        top = self._run(dp, _INF, False, _INF, False)
        if top is None or m1 == 0:
            return  # infeasible for this order, or no bottleneck term: the min-sum plan is optimal
        floor = m1 * (pw * self.lb_p + dw * self.lb_d)
        s_min = top.cost
        bd, sd = _INF, False
        if dw > 0 and math.isfinite(self.best_obj):
            bd = (self.best_obj - s_min - m1 * pw * self.lb_p) / (m1 * dw)
        while True:
            if top.cost + floor >= self.best_obj:
                return
            bp, sp = _INF, False
            if pw > 0 and math.isfinite(self.best_obj):
                bp = (self.best_obj - s_min - m1 * dw * self.lb_d) / (m1 * pw)
            row_first: _Path | None = None
            row_max_d = -_INF
            while self._budget_left():
                path = self._run(dp, bp, sp, bd, sd)
                if path is None:
                    break
                row_first = row_first or path
                row_max_d = max(row_max_d, path.max_decode_s)
                if path.cost + floor >= self.best_obj or pw == 0:
                    break
                bp, sp = path.max_prefill_s, True
            if row_first is None or dw == 0 or not self.complete:
                return
            top = row_first
            bd, sd = row_max_d, True


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
        if _interchangeable(instance, j, k) and (other.name < d.name):
            return _device_signature(instance, k)
    return (d.name,)


def _interchangeable(instance: PlanningInstance, a: int, b: int) -> bool:
    da, db = instance.devices[a], instance.devices[b]
    if (da.memory_bytes, da.host_bytes, da.host_to_device_bytes_per_s) != (
        db.memory_bytes,
        db.host_bytes,
        db.host_to_device_bytes_per_s,
    ):
        return False
    if instance.workspace_bytes[a] != instance.workspace_bytes[b]:
        return False
    others = [k for k in range(instance.n_devices) if k not in (a, b)]
    for costs in (instance.prefill, instance.decode):
        if not np.array_equal(costs.unit_time_s[:, a], costs.unit_time_s[:, b]):
            return False
        if costs.first_time_s[a] != costs.first_time_s[b] or costs.last_time_s[a] != costs.last_time_s[b]:
            return False
        if not np.array_equal(costs.send_s[a, others], costs.send_s[b, others]):
            return False
        if not np.array_equal(costs.send_s[others, a], costs.send_s[others, b]):
            return False
        if costs.send_s[a, b] != costs.send_s[b, a]:
            return False
    return True


def solve_dp(
    instance: PlanningInstance,
    *,
    orders: str = "auto",
    time_limit_s: float = 60.0,
    max_dp_calls: int = MAX_DP_CALLS,
) -> DPResult:
    """Best plan over the device orders of `orders` (see the module docstring for the guarantee)."""
    started = time.perf_counter()
    order_list, complete_orders = device_orders(instance, orders)
    search = _Search(instance, started + time_limit_s, max_dp_calls)
    searched = 0
    for order in order_list:
        if not search._budget_left():
            break
        search.search(order)
        searched += 1
    elapsed = time.perf_counter() - started
    exact = search.complete and complete_orders and searched == len(order_list)
    if search.best is None:
        return DPResult(None, None, exact, searched, len(order_list), search.calls, elapsed)
    solution = Solution(search.best.stages)
    return DPResult(solution, evaluate(instance, solution), exact, searched, len(order_list), search.calls, elapsed)
