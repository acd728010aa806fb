"""The planning MILP on HiGHS (`highspy`): free pipeline order, offloading, both passes.

Variables (u a unit, j, k devices; times in ms, bytes in GiB to keep coefficients near 1):

    x[u, j] in {0, 1}   unit u on device j                    sum_j x[u, j] = 1
    b[u, j] in [0, 1]   j's run starts at u       b[u, j] >= x[u, j] - x[u-1, j], sum_u b[u, j] <= 1
    y[j, k] in [0, 1]   k follows j in the pipeline           y[j, k] >= x[u, j] + x[u+1, k] - 1
    o[j] >= 0           GiB offloaded to host     o[j] >= held_j - G_j, o[j] <= host_j
    A[j] >= 0           offload time                          A[j] >= o[j] / B_j
    T^p[j], T^d[j]      stage times                           T >= compute + comm + A  (or >= each, overlap;
                                                              >= compute + A and >= comm on a device
                                                              whose copies share the compute's cores)
    M^p, M^d            bottlenecks                           M >= T[j]

with used_j = sum_u b[u, j] (1 on a used device, so the workspace is counted once), the first stage
(x[0, j] = 1) paying first_time / first_bytes, the last (x[U-1, j] = 1) last_time / last_bytes,
comm_j = sum_k send[j, k] y[j, k]. With `swap_in="hidden"` also the swap-in rule
`A[k] <= compute_j + comm_j + M (1 - y[j, k])` in both passes (big-M: the most A[k] can be), and
the first stage may not offload (`o[j] <= host_j (1 - x[0, j])`); both are `evaluate`'s rules.
b's sum-to-one makes runs contiguous without b being integral, and y needs no integrality either:
x forces it to 1 where k follows j and the objective pushes it to 0 elsewhere.

With `stream_layers` the MILP keeps A[j] >= o[j] / B_j: the whole layers the runtime copies are at
least the streamed bytes, so this is a lower bound on `evaluate`'s price (whole-layer rounding is
not linear in x), the MILP's objective and dual bound are bounds, and the plan it returns is priced
by `evaluate` (`solve` keeps the better of it and the DP's exact plan).

Objective: pw (sum T^p + (m-1) M^p) + dw (sum T^d + (m-1) M^d) (+ move_weight sum move_s[u, j]
x[u, j] when re-planning), exactly `evaluate`'s.

Precision per unit (when the instance has a choice): binary z[u, j, q] with x[u, j] = sum_q z[u, j, q];
a unit's weight bytes and times enter the memory and stage-time rows through z (its KV and the
first / last extras stay on x), the quality cost sum quality[u, q] z[u, j, q] is bounded by the
budget and weighted by theta in the objective.

Symmetry: devices that are exact copies (same numbers, same links to everything else) are ordered:
the later copy holds unit u only if the earlier one holds a unit before u.
Warm start: a plan (the DP's) is handed to HiGHS with `setSolution`; on the time limit the best
plan found so far is returned with HiGHS's dual bound and gap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tessel.plan.instance import PlanningInstance
from tessel.plan.precision.precision import same_precision_costs
from tessel.plan.solution import Evaluation, Solution, Stage, evaluate
from tessel.plan.solvers.highs import ModelBuilder, solve_mip
from tessel.plan.solvers.symmetry import interchangeable
from tessel.units import GIB

MS = 1e3  # seconds -> ms
SPAWN_GRACE_S = 5.0  # a spawned child imports numpy and highspy before it solves


@dataclass(frozen=True, slots=True)
class MILPResult:
    solution: Solution | None
    evaluation: Evaluation | None
    status: str  # HiGHS model status, e.g. "Optimal", "Time limit reached", "Infeasible"
    objective: float  # HiGHS's objective of the solution (s), inf when none
    bound: float  # HiGHS's dual bound (s)
    gap: float  # relative gap (objective - bound) / objective, inf when none
    time_s: float
    warm_started: bool
    n_cols: int
    n_rows: int


def build_model(instance: PlanningInstance) -> tuple[ModelBuilder, dict]:
    inst = instance
    U, N = inst.n_units, inst.n_devices
    mb = ModelBuilder()
    x = mb.cols((U, N), hi=1.0, integer=True)
    b = mb.cols((U, N), hi=1.0)
    y = mb.cols((N, N), hi=1.0)
    o = mb.cols((N,))
    A = mb.cols((N,))
    Tp, Td = mb.cols((N,)), mb.cols((N,))
    Mp, Md = mb.cols(()), mb.cols(())
    choice = inst.precision
    z = None if choice is None else mb.cols((U, N, len(choice.names)), hi=1.0, integer=True)
    for j in range(N):
        mb.upper[y[j, j]] = 0.0
    pw, dw, m1 = inst.prefill_weight, inst.decode_weight, inst.micro_batches - 1
    hidden = inst.swap_in == "hidden"
    for j in range(N):
        mb.cost[Tp[j]] = pw
        mb.cost[Td[j]] = dw
    mb.cost[int(Mp)] = pw * m1
    mb.cost[int(Md)] = dw * m1
    if inst.move_s is not None and inst.move_weight > 0:
        if inst.precision_move_costs:  # [U, N, P]: on the precision variables
            for (u, j, q), seconds in np.ndenumerate(inst.move_s):
                mb.cost[z[u, j, q]] += inst.move_weight * seconds * MS
        else:
            for (u, j), seconds in np.ndenumerate(inst.move_s):
                mb.cost[x[u, j]] = inst.move_weight * seconds * MS

    # assignment and contiguity
    mb.rows(x, 1.0, 1.0, 1.0)
    mb.rows(np.stack([b[0], x[0]], axis=1), [1.0, -1.0], 0.0, np.inf)
    if U > 1:
        cols = np.stack([b[1:], x[1:], x[:-1]], axis=-1).reshape(-1, 3)
        mb.rows(cols, [1.0, -1.0, 1.0], 0.0, np.inf)
    mb.rows(b.T, 1.0, -np.inf, 1.0)
    # successor: y[j, k] >= x[u, j] + x[u+1, k] - 1
    if U > 1 and N > 1:
        jj, kk = np.nonzero(~np.eye(N, dtype=bool))
        uu = np.repeat(np.arange(U - 1), len(jj))
        jr, kr = np.tile(jj, U - 1), np.tile(kk, U - 1)
        cols = np.stack([y[jr, kr], x[uu, jr], x[uu + 1, kr]], axis=1)
        mb.rows(cols, [1.0, -1.0, -1.0], -1.0, np.inf)
        mb.rows(y, 1.0, -np.inf, 1.0)  # one successor
        mb.rows(y.T, 1.0, -np.inf, 1.0)  # one predecessor

    if z is not None:
        _precision_rows(mb, inst, x, z)

    # memory and offloading: held_j - o_j <= G_j
    kv = inst.kv_restore is not None
    ks, kr = (mb.cols((N,)), mb.cols((N,))) if kv else (None, None)  # GiB of KV evicted, per mode
    unit_gib = (inst.kv_bytes if z is not None else inst.weight_bytes + inst.kv_bytes) / GIB
    for j, device in enumerate(inst.devices):
        cols = np.concatenate([x[:, j], b[:, j]])
        vals = np.concatenate([unit_gib, np.full(U, inst.workspace_bytes[j] / GIB)])
        vals[0] += inst.first_bytes / GIB
        vals[U - 1] += inst.last_bytes / GIB
        if z is not None:
            cols = np.concatenate([cols, z[:, j, :].reshape(-1)])
            vals = np.concatenate([vals, (choice.weight_bytes / GIB).reshape(-1)])
        held_row = (np.append(cols, o[j])[None, :], np.append(vals, -1.0)[None, :])
        mb.rows(*held_row, -np.inf, device.memory_bytes / GIB)
        host = device.host_bytes / GIB if device.host_to_device_bytes_per_s > 0 or kv else 0.0
        mb.upper[o[j]] = host
        if hidden:  # the first stage may not offload: o_j <= host (1 - x[0, j])
            mb.rows(np.array([[o[j], x[0, j]]]), [[1.0, host]], -np.inf, host)
        if kv and host > 0:
            _kv_rows(mb, inst, j, x[:, j], cols, vals, o[j], ks[j], kr[j], A[j], host)
        elif host > 0:
            ms_per_gib = GIB / device.host_to_device_bytes_per_s * MS
            mb.rows(np.array([[A[j], o[j]]]), [[1.0, -ms_per_gib]], 0.0, np.inf)
            mb.upper[A[j]] = host * ms_per_gib
        else:
            mb.upper[A[j]] = 0.0
            if kv:
                mb.upper[ks[j]] = mb.upper[kr[j]] = 0.0

    # stage times
    compute = {}
    for name, costs, T, M in (("p", inst.prefill, Tp, Mp), ("d", inst.decode, Td, Md)):
        t = costs.unit_time_s * MS
        send = costs.send_s * MS
        for j in range(N):
            c_cols = x[:, j]
            c_vals = t[:, j].copy() if z is None else np.zeros(U)
            c_vals[0] += costs.first_time_s[j] * MS
            c_vals[U - 1] += costs.last_time_s[j] * MS
            if z is not None:
                per_q = choice.prefill_time_s if name == "p" else choice.decode_time_s
                c_cols = np.concatenate([c_cols, z[:, j, :].reshape(-1)])
                c_vals = np.concatenate([c_vals, (per_q[:, j, :] * MS).reshape(-1)])
            s_cols, s_vals = y[j], send[j].copy()
            s_vals[j] = 0.0
            compute[name, j] = (c_cols, c_vals, s_cols, s_vals)
            if inst.overlap:  # T >= compute (+ A on a device whose copies share its cores), T >= comm
                shared = inst.devices[j].copies_share_compute
                if shared:
                    _at_least(mb, T[j], np.concatenate([[A[j]], c_cols]), np.concatenate([[1.0], c_vals]))
                else:
                    _at_least(mb, T[j], c_cols, c_vals)
                _at_least(mb, T[j], s_cols, s_vals)
                if not shared:
                    _at_least(mb, T[j], [A[j]], [1.0])
            else:
                _at_least(
                    mb,
                    T[j],
                    np.concatenate([c_cols, s_cols, [A[j]]]),
                    np.concatenate([c_vals, s_vals, [1.0]]),
                )
            _at_least(mb, M, [T[j]], [1.0])

    # swap-in hidden under the upstream stage j of k: A[k] <= compute_j + comm_j + bigM (1 - y[j, k])
    for k in range(N if hidden else 0):
        big_m = mb.upper[A[k]]
        if big_m <= 0:
            continue
        for j in range(N):
            if j == k:
                continue
            for name in ("p", "d"):
                c_cols, c_vals, s_cols, s_vals = compute[name, j]
                cols = np.concatenate([[A[k], y[j, k]], c_cols, s_cols])
                vals = np.concatenate([[1.0, big_m], -c_vals, -s_vals])
                mb.rows(cols[None], vals[None], -np.inf, big_m)

    _symmetry_rows(mb, inst, x)
    return mb, {
        "x": x,
        "b": b,
        "y": y,
        "o": o,
        "A": A,
        "Tp": Tp,
        "Td": Td,
        "Mp": Mp,
        "Md": Md,
        "z": z,
        "ks": ks,
        "kr": kr,
    }


def _at_least(mb: ModelBuilder, col, cols, vals) -> None:
    """The row col >= sum vals * cols."""
    row_cols = np.concatenate([[col], np.asarray(cols)])
    row_vals = np.concatenate([[1.0], -np.asarray(vals, dtype=float)])
    mb.rows(row_cols[None], row_vals[None], 0.0, np.inf)


def _kv_rows(mb, inst, j, xj, held_cols, held_vals, o, ks, kr, A, host) -> None:
    """Evicted KV (ks swapped, kr recomputed, GiB) within the stage's KV, streamed weights o - ks - kr
    within the rest it holds, and A >= streamed / B + (swap ks + recompute kr) / m (ms)."""
    kv_gib = inst.kv_bytes / GIB
    mb.rows(np.concatenate([[ks, kr], xj])[None], np.concatenate([[1.0, 1.0], -kv_gib])[None], -np.inf, 0.0)
    rest = held_vals.copy()
    rest[: inst.n_units] -= kv_gib  # held - KV: weights, workspace, embedding / LM head
    cols = np.concatenate([[o, ks, kr], held_cols])
    mb.rows(cols[None], np.concatenate([[1.0, -1.0, -1.0], -rest])[None], -np.inf, 0.0)
    mb.rows(np.array([[o, ks, kr]]), [[1.0, -1.0, -1.0]], 0.0, np.inf)  # streamed >= 0
    bw = inst.devices[j].host_to_device_bytes_per_s
    ms_per_gib = GIB / bw * MS if bw > 0 else None
    swap_ms = inst.kv_rate_s_per_byte(j, "swap") * GIB * MS
    rec_ms = inst.kv_rate_s_per_byte(j, "recompute") * GIB * MS
    if ms_per_gib is None:  # no host link for weights: only KV may leave
        mb.rows(np.array([[o, ks, kr]]), [[1.0, -1.0, -1.0]], -np.inf, 0.0)
        mb.rows(np.array([[A, ks, kr]]), [[1.0, -swap_ms, -rec_ms]], 0.0, np.inf)
    else:
        coefs = [[1.0, -ms_per_gib, ms_per_gib - swap_ms, ms_per_gib - rec_ms]]
        mb.rows(np.array([[A, o, ks, kr]]), coefs, 0.0, np.inf)
    mb.upper[A] = host * max(ms_per_gib or 0.0, swap_ms, rec_ms)


def _precision_rows(mb: ModelBuilder, instance: PlanningInstance, x: np.ndarray, z: np.ndarray) -> None:
    """x[u, j] = sum_q z[u, j, q]; quality within the budget; theta * quality in the objective."""
    choice = instance.precision
    U, N, P = z.shape
    mb.rows(np.concatenate([x[..., None], z], axis=2).reshape(U * N, P + 1), [1.0] + [-1.0] * P, 0.0, 0.0)
    quality = np.broadcast_to(choice.quality[:, None, :], z.shape)
    scale = float(quality.max()) or 1.0  # keeps the budget row's coefficients near 1
    if np.isfinite(choice.quality_budget):
        mb.rows(z.reshape(1, -1), (quality / scale).reshape(1, -1), -np.inf, choice.quality_budget / scale)
    if choice.theta > 0:
        for index, value in np.ndenumerate(quality):
            mb.cost[z[index]] += choice.theta * value * MS


def _copy_groups(instance: PlanningInstance) -> list[list[int]]:
    """Devices that are exact copies of each other, in index order."""
    seen: set[int] = set()
    groups = []
    for j in range(instance.n_devices):
        if j in seen:
            continue
        copies = [j] + [
            k
            for k in range(j + 1, instance.n_devices)
            if k not in seen and interchangeable(instance, j, k) and same_precision_costs(instance, j, k)
        ]
        seen.update(copies)
        groups.append(copies)
    return groups


def canonical(instance: PlanningInstance, solution: Solution) -> Solution:
    """The same plan with exact copies used in index order along the pipeline (what the symmetry
    rows admit); it evaluates the same."""
    rename = {}
    for copies in _copy_groups(instance):
        used = [s.device for s in solution.stages if s.device in copies]
        rename.update(zip(used, sorted(used), strict=True))
    stages = tuple(Stage(rename.get(s.device, s.device), s.unit_start, s.unit_end) for s in solution.stages)
    return Solution(stages, solution.precisions)


def _symmetry_rows(mb: ModelBuilder, instance: PlanningInstance, x: np.ndarray) -> None:
    """For exact copies j1 < j2: x[u, j2] <= sum_{u' < u} x[u', j1]."""
    U = instance.n_units
    for copies in _copy_groups(instance):
        for a, b in zip(copies, copies[1:], strict=False):
            mb.rows(np.array([[x[0, b]]]), [[1.0]], -np.inf, 0.0)
            for u in range(1, U):
                cols = np.concatenate([[x[u, b]], x[:u, a]])
                vals = np.concatenate([[1.0], -np.ones(u)])
                mb.rows(cols[None], vals[None], -np.inf, 0.0)


def _start_values(instance: PlanningInstance, cols: dict, n_cols: int, solution: Solution) -> np.ndarray:
    """Column values of a plan (all columns, consistent with the rows)."""
    inst = instance
    values = np.zeros(n_cols)
    ev = evaluate(instance, solution)
    for index, stage in enumerate(solution.stages):
        j = stage.device
        values[cols["x"][stage.unit_start : stage.unit_end, j]] = 1.0
        values[cols["b"][stage.unit_start, j]] = 1.0
        if index + 1 < len(solution.stages):
            values[cols["y"][j, solution.stages[index + 1].device]] = 1.0
        se = ev.stages[index]
        values[cols["o"][j]] = se.offload_bytes / GIB
        if cols["ks"] is not None:
            mode_col = cols["ks"] if se.kv_preemption == "swap" else cols["kr"]
            values[mode_col[j]] = se.kv_evicted_bytes / GIB
        values[cols["A"][j]] = se.offload_s * MS
        values[cols["Tp"][j]] = se.time_prefill_s * MS
        values[cols["Td"][j]] = se.time_decode_s * MS
    values[cols["Mp"]] = ev.max_prefill_s * MS
    values[cols["Md"]] = ev.max_decode_s * MS
    if cols["z"] is not None:
        q = solution.precisions or (0,) * inst.n_units
        owner = solution.assignment(inst.n_units)
        values[cols["z"][np.arange(inst.n_units), owner, list(q)]] = 1.0
    del inst
    return values


def _extract(instance: PlanningInstance, cols: dict, values: np.ndarray) -> Solution:
    owner = np.argmax(values[cols["x"]], axis=1)
    stages, start = [], 0
    for u in range(1, instance.n_units + 1):
        if u == instance.n_units or owner[u] != owner[start]:
            stages.append(Stage(int(owner[start]), start, u))
            start = u
    if cols["z"] is None:
        return Solution(tuple(stages))
    units = np.arange(instance.n_units)
    precisions = np.argmax(values[cols["z"]][units, owner], axis=1)
    return Solution(tuple(stages), tuple(int(q) for q in precisions))


def solve_milp(
    instance: PlanningInstance,
    *,
    time_limit_s: float = 60.0,
    mip_gap: float = 0.01,
    warm_start: Solution | None = None,
    threads: int | None = None,
    verbose: bool = False,
    isolate: bool = False,
) -> MILPResult:
    """Solve the MILP; with `isolate` HiGHS runs in a child process.

    HiGHS 1.15 can segfault, or run far past its time limit (seen in a phase where no interrupt
    callback fires), on some instances of this model. In a child, a crash or a hang costs only the
    MILP's answer (status "solver crashed" / "solver hung"): the child is killed at the time limit
    plus a short grace, and `solve` keeps the DP's plan. `solve` always isolates for that reason.
    The child is a fresh interpreter (`python -m tessel.plan.solvers.milp`), sharing no HiGHS state."""
    kwargs = dict(
        time_limit_s=time_limit_s, mip_gap=mip_gap, warm_start=warm_start, threads=threads, verbose=verbose
    )
    if not isolate:
        return _solve_milp(instance, **kwargs)
    import pickle
    import subprocess
    import sys

    started = time.perf_counter()
    # a fresh interpreter, not a fork: a child forked after HiGHS ran in this process (the DP's LP
    # bound does) can deadlock on HiGHS's inherited threads; `python -m` imports no user script
    child = subprocess.Popen(
        [sys.executable, "-m", "tessel.plan.solvers.milp"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    # starting the interpreter, building the model and the last node can overrun a little
    grace_s = SPAWN_GRACE_S + max(2.0, 0.1 * time_limit_s)
    status, result = "solver hung", None
    try:
        message = pickle.dumps((instance, kwargs, time.time()))
        out, _ = child.communicate(message, timeout=time_limit_s + grace_s)
        if child.returncode == 0:
            result = pickle.loads(out)
        else:
            status = "solver crashed"
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
    if isinstance(result, MILPResult):
        return result
    return MILPResult(
        None,
        None,
        status,
        np.inf,
        -np.inf,
        np.inf,
        time.perf_counter() - started,
        warm_start is not None,
        0,
        0,
    )


def _child_main() -> None:
    """`python -m tessel.plan.solvers.milp`: (instance, options, wall-clock time sent) pickled on
    stdin, the MILPResult on stdout. HiGHS's own prints (C level, fd 1) go to stderr so they cannot
    mix with the result."""
    import os
    import pickle
    import sys

    from tessel.plan.solvers import milp  # by its own name: results pickle as tessel.plan.solvers.milp.*

    result_fd = os.dup(1)
    os.dup2(2, 1)
    instance, kwargs, sent_at = pickle.loads(sys.stdin.buffer.read())
    # the interpreter's start and imports count against the parent's limit
    kwargs["time_limit_s"] = max(kwargs["time_limit_s"] - max(time.time() - sent_at, 0.0), 0.1)
    with os.fdopen(result_fd, "wb") as out:
        out.write(pickle.dumps(milp._solve_milp(instance, **kwargs)))


def _solve_milp(
    instance: PlanningInstance,
    *,
    time_limit_s: float,
    mip_gap: float,
    warm_start: Solution | None,
    threads: int | None,
    verbose: bool,
) -> MILPResult:
    started = time.perf_counter()
    mb, cols = build_model(instance)
    start = None
    if warm_start is not None:
        start = _start_values(instance, cols, mb.n_cols, canonical(instance, warm_start))
    found = solve_mip(
        mb,
        started=started,
        time_limit_s=time_limit_s,
        mip_gap=mip_gap,
        cost_divisor=MS,
        start=start,
        threads=threads,
        verbose=verbose,
    )
    elapsed = time.perf_counter() - started
    shape = (found.warm_started, mb.n_cols, mb.n_rows)
    if found.values is None:
        return MILPResult(None, None, found.status, np.inf, found.dual_bound, np.inf, elapsed, *shape)
    solution = _extract(instance, cols, found.values)
    objective, bound = found.objective, found.dual_bound
    gap = max(objective - bound, 0.0) / abs(objective) if objective else 0.0
    return MILPResult(
        solution, evaluate(instance, solution), found.status, objective, bound, gap, elapsed, *shape
    )


if __name__ == "__main__":
    _child_main()
