"""An upper bound on the summed throughput of every split of a cluster into replicas.

`choose_replicas` tries every partition of up to 6 devices; beyond, it tries candidate splits only.
This bound covers every split (any number of replicas, idle devices allowed, any plan of each group),
so the best split found is within a proven gap of the best split there is.

Per replica (group G of devices, plan with n_j units on device j, its share of k_G of the workload's
m micro-batches of b requests, 1 <= k_G <= m, KV of its k_G micro-batches: `instance.share`,
n_out = decode_weight / prefill_weight), `tessel.plan.report.predict` gives

    throughput(G) = k b n_out / (P + n_out D),   P = sum_j T^pre_j + (k-1) max_j T^pre_j

and likewise D. With W_j = T^pre_j + n_out T^dec_j, P + n_out D >= sum_j W_j + (k-1) max_j W_j, and
W_j >= phi_j(n_j), a lower bound on device j's weighted stage time when it holds any n units
(the bytes of a unit are at least beta, its weights plus the KV of one micro-batch, since k >= 1):

    phi_j(n) = n w_j + k off_j(n)          (additive stage time)
    phi_j(n) = max(n w_j, k off_j(n))      (overlap: T = max(compute, comm, offload))
    w_j = min over units of (prefill + n_out decode time on j),  k = 1 + n_out,
    off_j(n) = max(n beta + workspace_j - memory_j, 0) / host-to-device bandwidth_j,
    beta = the fewest bytes (weights + KV of one micro-batch: kv_bytes / m) of any unit,
    n <= cap_j (what device + host memory hold).

Precisions enter through `PlanningInstance.relaxed` (every unit at its fewest bytes and least time);
communication, the first / last stage extras and the swap-in rule are left out (they only add).
With L_G = max_j phi_j(n_j): sum_j W_j >= max(L_G, U w*) (w* the least w_j of all devices), so
P + n_out D >= k psi_k(L_G), psi_k(L) = L + (max(L, U w*) - L) / k >= psi(L) := psi_m(L) >= L, as
k <= m: every replica's throughput is at most b n_out / psi(L_G) whatever its share. Let r_j(L) = the most
units device j holds with phi_j <= L (concave piecewise-linear in L). Then
U = sum_{j in G} n_j <= sum_{j in G} r_j(L_G), and L_G >= L* := the least L with sum over all
devices r_j(L) >= U. Hence

    sum_G throughput(G) <= b n_out / U * sum_G sum_{j in G} r_j(L_G) / psi(L_G)
                        <= b n_out / U * sum_j max_{L >= L*} r_j(L) / psi(L),

the maximum over L taken at L*, at a breakpoint of r_j or of psi, or in the limit L -> inf
(between breakpoints r_j / psi is a ratio of linear functions, hence monotone).

That bound lets every device work at once, which needs requests in flight on all of them; the
workload has only m micro-batches in flight (sum_G k_G <= m). The flow bound counts both limits
per unit and device. With x_G = throughput(G) / (b n_out), R_G = P + n_out D, and a_uj = x_G for
unit u on device j of replica G (a rate of unit crossings):

    R_G >= sum_j W_j + (k_G - 1) max_j W_j >= k_G max_j W_j, so x_G W_j = k_G W_j / R_G <= 1:
        sum_u a_uj w_uj <= 1 for every device j (its busy time)
    R_G >= sum_j W_j, so x_G sum_{j in G} W_j <= k_G and, summed over the replicas,
        sum_{u, j} a_uj w_uj <= m (Little's law: the micro-batches in flight)
    every replica holds every unit once: sum_j a_uj = sum_G x_G =: Y for every unit u

(w_uj: unit u's least prefill + n_out decode time on device j, `_work`; W_j >= sum of its units'
w_uj). The most Y of this linear program (HiGHS) bounds every split: sum_G throughput(G) <=
b n_out Y*. It leaves memory out, which the fluid bound counts; the bound returned is the smaller
of the two.
Tested against brute force over every partition with every plan of each group
(`tests/plan/test_replica_bound.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import FEASIBILITY_ATOL_BYTES, FEASIBILITY_RTOL
from tessel.plan.solvers.highs import solve_lp

BISECTION_STEPS = 200
LP_SLACK = 1e-6  # relative: HiGHS's optimum is exact only to its tolerances


@dataclass(frozen=True, slots=True)
class _Device:
    """phi(n) = max over lines of (slope * n + intercept), for 0 <= n <= cap."""

    lines: tuple[tuple[float, float], ...]
    cap: float

    def units(self, load: float) -> float:
        """r(L): the most units with phi <= L (0 when not even one fraction fits)."""
        most = self.cap
        for slope, intercept in self.lines:
            if slope > 0:
                most = min(most, (load - intercept) / slope)
            elif intercept > load:
                return 0.0
        return max(most, 0.0)

    def breakpoints(self) -> list[float]:
        """Loads where r changes slope: r leaves 0, two lines cross, the cap starts to bind."""
        points = [intercept for _, intercept in self.lines]
        points += [slope * self.cap + intercept for slope, intercept in self.lines if math.isfinite(self.cap)]
        for i, (a1, c1) in enumerate(self.lines):
            for a2, c2 in self.lines[i + 1 :]:
                if a1 > 0 and a2 > 0 and a1 != a2:  # (L - c1) / a1 = (L - c2) / a2
                    points.append((a1 * c2 - a2 * c1) / (a1 - a2))
        return points

    def best_rate(self, least_load: float, psi: _Psi) -> float:
        """max over L >= least_load of r(L) / psi(L) (units per second of weighted load)."""
        points = [*self.breakpoints(), psi.knee]
        candidates = [least_load, *(p for p in points if p > least_load)]
        best = max(self.units(load) / psi(load) for load in candidates if load > 0)
        if not math.isfinite(self.cap):  # r(L) / psi(L) tends to 1 / (steepest slope) as L grows
            steepest = max(slope for slope, _ in self.lines)
            best = max(best, 1.0 / steepest) if steepest > 0 else math.inf
        return best


@dataclass(frozen=True, slots=True)
class _Psi:
    """psi(L) = ((m - 1) L + max(L, knee)) / m: a replica's objective / m when its bottleneck is L."""

    micro_batches: int
    knee: float  # U w*: every unit on the fastest device

    def __call__(self, load: float) -> float:
        m = self.micro_batches
        return ((m - 1) * load + max(load, self.knee)) / m


def _work(instance: PlanningInstance) -> np.ndarray:
    """[U, N] prefill + n_out decode time of each unit on each device, at its least over precisions."""
    relaxed = instance.relaxed()
    n_out = relaxed.decode_weight / relaxed.prefill_weight
    return relaxed.prefill.unit_time_s + n_out * relaxed.decode.unit_time_s


def _devices(instance: PlanningInstance) -> list[_Device]:
    relaxed = instance.relaxed()
    k = 1.0 + relaxed.decode_weight / relaxed.prefill_weight
    work = _work(instance)
    beta = float(np.min(relaxed.weight_bytes + relaxed.kv_bytes / relaxed.micro_batches))
    devices = []
    for j, slot in enumerate(relaxed.devices):
        w = float(np.min(work[:, j]))
        spare = slot.memory_bytes - float(relaxed.workspace_bytes[j])  # offload starts past this
        host = slot.host_bytes * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_BYTES
        cap = (spare + host) / beta if beta > 0 else math.inf
        rate = relaxed.offload_bytes_per_s_bound(j)  # evicted KV may come back faster than weights
        if rate <= 0:  # no host link: nothing may be offloaded
            cap = min(cap, max(spare, 0.0) / beta) if beta > 0 else cap
            offload = (0.0, 0.0)
        else:
            offload = (k * beta / rate, -k * spare / rate)  # k (n beta - spare) / rate
        if instance.overlap:
            lines = ((w, 0.0), offload, (0.0, 0.0))
        else:
            lines = ((w, 0.0), (w + offload[0], offload[1]))
        devices.append(_Device(lines, cap))
    return devices


def split_upper_bound_tok_s(instance: PlanningInstance, micro_batch_size: int) -> float:
    """Upper bound on the summed predicted throughput (tokens/s) of every split of the instance's
    devices into replicas, each with any share of the micro-batches and planned any way (module
    docstring); 0 when no split can hold the model, inf when a device costs no time."""
    fluid = _fluid_bound_tok_s(instance, micro_batch_size)
    return min(fluid, flow_bound_tok_s(instance, micro_batch_size)) if fluid > 0 else fluid


def flow_bound_tok_s(instance: PlanningInstance, micro_batch_size: int) -> float:
    """b n_out Y*: the flow bound's linear program (module docstring); inf when a unit costs no time
    on some device (the program is unbounded) or HiGHS finds no optimum (no bound is claimed then)."""
    work = _work(instance)  # [U, N]
    n_units, n_devices = work.shape
    n_vars = n_units * n_devices + 1  # a_uj row-major, then Y
    flat = np.arange(n_units * n_devices)
    units, devices = flat // n_devices, flat % n_devices
    # rows 0..U-1: sum_j a_uj - Y = 0; U..U+N-1: device busy time <= 1; U+N: in flight <= m
    rows = np.concatenate(
        [units, np.arange(n_units), n_units + devices, np.full(flat.size, n_units + n_devices)]
    )
    cols = np.concatenate([flat, np.full(n_units, n_vars - 1), flat, flat])
    vals = np.concatenate([np.ones(flat.size), -np.ones(n_units), work.reshape(-1), work.reshape(-1)])
    row_lower = np.concatenate([np.zeros(n_units), np.full(n_devices + 1, -np.inf)])
    row_upper = np.concatenate([np.zeros(n_units), np.ones(n_devices), [float(instance.micro_batches)]])
    cost = np.zeros(n_vars)
    cost[-1] = -1.0
    least = solve_lp(cost, np.zeros(n_vars), np.full(n_vars, np.inf), rows, cols, vals, row_lower, row_upper)
    if least is None:
        return math.inf
    n_out = instance.decode_weight / instance.prefill_weight
    return micro_batch_size * n_out * -least * (1 + LP_SLACK)


def _fluid_bound_tok_s(instance: PlanningInstance, micro_batch_size: int) -> float:
    """The bound with every device busy at once (module docstring, first part)."""
    devices = _devices(instance)
    units = float(instance.n_units)
    if sum(d.units(math.inf) for d in devices) < units:
        return 0.0
    low, high = 0.0, 1.0
    while sum(d.units(high) for d in devices) < units:
        high *= 2.0
        if not math.isfinite(high):
            return 0.0
    for _ in range(BISECTION_STEPS):  # low stays below the least feasible load
        middle = 0.5 * (low + high)
        if sum(d.units(middle) for d in devices) >= units:
            high = middle
        else:
            low = middle
    if low <= 0.0:
        return math.inf
    n_out = instance.decode_weight / instance.prefill_weight
    psi = _Psi(instance.micro_batches, units * float(np.min(_work(instance))))
    rates = sum(d.best_rate(low, psi) for d in devices)
    return micro_batch_size * n_out * rates / units
