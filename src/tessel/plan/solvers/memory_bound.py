"""An upper bound on the throughput of every plan whose concurrency is set by memory, counting GPU
memory and requests in flight in one linear program (HiGHS).

Plans covered: any split of the devices into replicas (disjoint pipelines, idle devices allowed),
replica G holding k_G micro-batches of b requests with every stage's weights, extras, workspace and
the KV of its k_G micro-batches at full length in its GPU memory (no offloading: `concurrency=
"memory"` in `tessel.plan.replicas.replicas`), any k_G, at most `max_micro_batches` in all when given.

With x_G = throughput(G) / (b n_out) (micro-batch completions per second), W_j = T^pre_j + n_out
T^dec_j and R_G = P + n_out D >= sum_j W_j + (k_G - 1) max_j W_j (`tessel.plan.replicas.replica_bound`),
x_G = k_G / R_G, and for unit u on device j of replica G:

    a_uj = x_G (rate of unit-u crossings on j),  c_uj = k_G (micro-batches whose unit-u KV is on j),
    z_uj = 1 (unit u's weights on j),             y_j = 1 (device j used)

and 0 elsewhere. Every replica plan satisfies (w_uj: unit u's prefill + n_out decode time on j, at
most its share of W_j; kv_u: unit u's KV of one micro-batch):

    sum_j a_uj = Y                    every unit is crossed at the total rate Y = sum_G x_G
    sum_j c_uj = K                    every unit's KV for all K = sum_G k_G micro-batches in flight
    sum_u w_uj a_uj <= 1              a device's busy time: x_G W_j <= k_G W_j / R_G <= 1
    sum_uj w_uj a_uj <= K             Little's law: x_G sum_j W_j <= k_G, summed over the replicas
    w_uj a_uj <= c_uj                 the same for one unit: x_G w_uj <= x_G sum_j W_j <= k_G
    w_uj a_uj <= z_uj                 a device crosses only units it holds
    c_uj <= K_max z_uj                KV only where the weights are (K_max: most any replica holds)
    z_uj <= y_j,  sum_j z_uj >= 1     every unit held somewhere
    sum_u (weights_u z_uj + kv_u c_uj) + first z_0j + last z_(U-1)j + workspace_j y_j <= memory_j

so the most Y of the program (z, y relaxed to [0, 1]; binary with `integral=True`, HiGHS's dual
bound then) bounds every such plan: throughput <= b n_out Y*. Communication, the first / last stage
times and contiguity are left out (they only lower a plan's throughput). With a precision choice
every unit takes its fewest bytes and least time (`PlanningInstance.relaxed`).

**Pipeline fill** (`pipelines=True`; disjoint pipelines only). The rows above let every device be
busy all the time, which no pipeline of two or more stages is under the pipeline formula: with
R_G >= S_G + (k_G - 1) M_G (S the sum of W_j, M their max), device j is busy
rho_j = x_G W_j <= k_G W_j / (S_G + (k_G - 1) W_j) = k_G W_j / (R_j + k_G W_j), R_j = S_G - W_j the
rest of the pipeline. With n units on j: W_j is at most the n largest w_uj, R_j at least the U - n
smallest min_i w_ui, and k_G at most what j's memory holds beside the n smallest weights (KV of the
n smallest units per micro-batch; at most `max_micro_batches`); the bound rises with W and k and falls
with R, so rho_j <= H_j(n), and the rows sum_u w_uj a_uj <= the concave envelope of H_j at
n_j = sum_u z_uj hold for every such plan. Flow plans whose paths share a device are not covered:
the shares' formula charges one bubble per path, so many one-micro-batch paths pay none.
Tested against brute force over every partition, every k and every plan of each group
(`tests/plan/test_memory_concurrency.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import FEASIBILITY_ATOL_BYTES, FEASIBILITY_RTOL
from tessel.plan.solvers.highs import highs_lp, new_highs

LP_SLACK = 1e-6  # relative: HiGHS's optimum is exact only to its tolerances


@dataclass(frozen=True, slots=True)
class MemoryBound:
    throughput_tok_s: float  # b n_out Y* (inf: unbounded, 0: nothing fits)
    micro_batches: float  # K at the optimum: micro-batches in flight the bound's solution holds
    integral: bool  # z binary (HiGHS's dual bound of the MILP) or relaxed
    status: str


def memory_flow_bound(
    instance: PlanningInstance,
    micro_batch_size: int,
    *,
    max_micro_batches: int | None = None,
    integral: bool = False,
    time_limit_s: float = 30.0,
    aggregate: bool = True,
    pipelines: bool = False,
) -> MemoryBound:
    """The module docstring's bound on the summed throughput (tokens/s). `aggregate` (relaxed
    program only): devices alike in every coefficient share one set of columns, weighted by their
    count (`_alike`), which leaves the optimum unchanged and the program a type's size."""
    import highspy

    relaxed = instance.relaxed()
    n_out = relaxed.decode_weight / relaxed.prefill_weight
    work = relaxed.prefill.unit_time_s + n_out * relaxed.decode.unit_time_s  # [U, N]
    if np.any(work <= 0):
        return MemoryBound(math.inf, math.inf, integral, "a unit costs no time")
    kv = np.asarray(relaxed.kv_bytes, dtype=float) / relaxed.micro_batches  # one micro-batch
    weights = np.asarray(relaxed.weight_bytes, dtype=float)
    memory = np.array([d.memory_bytes for d in relaxed.devices]) * (1 + FEASIBILITY_RTOL)
    memory = memory + FEASIBILITY_ATOL_BYTES
    workspace = np.asarray(relaxed.workspace_bytes, dtype=float)
    spare = float(memory.sum() - weights.sum() - relaxed.first_bytes - relaxed.last_bytes)
    if aggregate and not integral:
        keep, count = _alike(work, memory, workspace)
        work, memory, workspace = work[:, keep], memory[keep], workspace[keep]
    else:
        count = np.ones(work.shape[1])
    n_units, n_devices = work.shape
    if spare < 0:
        return MemoryBound(0.0, 0.0, integral, "the model's weights exceed all GPU memory")
    k_max = spare / kv.sum() if kv.sum() > 0 else math.inf
    if max_micro_batches is not None:
        k_max = min(k_max, float(max_micro_batches))
    if not math.isfinite(k_max):
        k_max = 1e9  # no KV at all: K is then bounded by the time rows only

    UN = n_units * n_devices
    A, C, Z = 0, UN, 2 * UN  # blocks of [U, N] variables, row-major
    Y_col, K_col, Y0 = 3 * UN, 3 * UN + 1, 3 * UN + 2  # then y_j
    n_cols = Y0 + n_devices
    flat = np.arange(UN)
    u_of, j_of = flat // n_devices, flat % n_devices
    w = work.reshape(-1)
    rows, cols, vals, lower, upper = [], [], [], [], []

    def add(block_rows, block_cols, block_vals, lo, hi):
        start = len(lower)
        rows.append(np.asarray(block_rows) + start)
        cols.append(np.asarray(block_cols))
        vals.append(np.asarray(block_vals, dtype=float))
        lower.extend(lo)
        upper.extend(hi)

    inf = np.inf
    # sum_j a_uj - Y = 0 and sum_j c_uj - K = 0
    counted = count[j_of]  # a column of alike devices stands for `count` of them in the sums
    for block, total in ((A, Y_col), (C, K_col)):
        add(
            np.concatenate([u_of, np.arange(n_units)]),
            np.concatenate([block + flat, np.full(n_units, total)]),
            np.concatenate([counted, -np.ones(n_units)]),
            [0.0] * n_units,
            [0.0] * n_units,
        )
    add(j_of, A + flat, w, [-inf] * n_devices, [1.0] * n_devices)  # busy time
    add(
        np.concatenate([np.zeros(UN, int), [0]]),
        np.concatenate([A + flat, [K_col]]),
        np.concatenate([w * counted, [-1.0]]),
        [-inf],
        [0.0],
    )  # Little's law
    per = np.arange(UN)
    add(
        np.concatenate([per, per]),
        np.concatenate([A + flat, C + flat]),
        np.concatenate([w, -np.ones(UN)]),
        [-inf] * UN,
        [0.0] * UN,
    )  # w a <= c
    add(
        np.concatenate([per, per]),
        np.concatenate([A + flat, Z + flat]),
        np.concatenate([w, -np.ones(UN)]),
        [-inf] * UN,
        [0.0] * UN,
    )  # w a <= z
    add(
        np.concatenate([per, per]),
        np.concatenate([C + flat, Z + flat]),
        np.concatenate([np.ones(UN), -np.full(UN, k_max)]),
        [-inf] * UN,
        [0.0] * UN,
    )  # c <= K_max z
    add(
        np.concatenate([per, per]),
        np.concatenate([Z + flat, Y0 + j_of]),
        np.concatenate([np.ones(UN), -np.ones(UN)]),
        [-inf] * UN,
        [0.0] * UN,
    )  # z <= y
    add(u_of, Z + flat, counted, [1.0] * n_units, [inf] * n_units)  # every unit held
    extras = weights[u_of].copy()
    extras[u_of == 0] += relaxed.first_bytes
    extras[u_of == n_units - 1] += relaxed.last_bytes
    add(
        np.concatenate([j_of, j_of, np.arange(n_devices)]),
        np.concatenate([Z + flat, C + flat, Y0 + np.arange(n_devices)]),
        np.concatenate([extras, kv[u_of], workspace]),
        [-inf] * n_devices,
        list(memory),
    )  # memory

    if pipelines:
        fill = _fill_rows(work, memory, workspace, weights, kv, max_micro_batches, A, Z)
        for row_cols, row_vals, top in fill:  # busy time under the pipeline fill
            add(np.zeros(len(row_cols), int), row_cols, row_vals, [-inf], [top])
    col_lower = np.zeros(n_cols)
    col_upper = np.full(n_cols, inf)
    col_upper[Z : Z + UN] = 1.0
    col_upper[Y0:] = 1.0
    col_upper[K_col] = k_max
    cost = np.zeros(n_cols)
    cost[Y_col] = -1.0
    integer = None
    if integral:
        integer = np.zeros(n_cols, dtype=bool)
        integer[Z : Z + UN] = True
        integer[Y0:] = True
    lp = highs_lp(
        cost,
        col_lower,
        col_upper,
        np.concatenate(rows),
        np.concatenate(cols),
        np.concatenate(vals),
        np.array(lower),
        np.array(upper),
        integer,
    )
    h = new_highs()
    h.setOptionValue("time_limit", float(time_limit_s))
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    if integral:
        dual = float(info.mip_dual_bound)
        if not math.isfinite(dual):
            return MemoryBound(math.inf, math.inf, integral, str(status))
        best = -dual
    else:
        if status == highspy.HighsModelStatus.kInfeasible:
            return MemoryBound(0.0, 0.0, integral, "no plan holds the model in GPU memory")
        if status != highspy.HighsModelStatus.kOptimal:
            return MemoryBound(math.inf, math.inf, integral, str(status))
        best = -float(info.objective_function_value)
    solution = h.getSolution().col_value
    k = float(solution[K_col]) if len(solution) == n_cols else math.nan
    tok_s = micro_batch_size * n_out * best * (1 + LP_SLACK)
    return MemoryBound(tok_s, k, integral, h.modelStatusToString(status))


def _alike(work: np.ndarray, memory: np.ndarray, workspace: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first device of each class, class sizes) for devices equal in every coefficient of the
    program. Swapping two such devices maps solutions to solutions, and the program is convex, so
    averaging an optimum over those swaps is an optimum that treats them alike: the program over
    one column set per class, its sums counting each class's size, has the same optimum."""
    keys: dict[bytes, int] = {}
    first, sizes = [], []
    for j in range(work.shape[1]):
        key = np.concatenate([work[:, j], [memory[j], workspace[j]]]).tobytes()
        if key not in keys:
            keys[key] = len(first)
            first.append(j)
            sizes.append(0)
        sizes[keys[key]] += 1
    return np.array(first, dtype=int), np.array(sizes, dtype=float)


def fill_ceiling(
    work_j: np.ndarray,
    least_work: np.ndarray,
    memory_bytes: float,
    workspace_bytes: float,
    weights: np.ndarray,
    kv: np.ndarray,
    max_micro_batches: int | None,
) -> np.ndarray:
    """H_j(n), n = 0..U: the most of its time device j is busy in a pipeline of the memory model
    when it holds n units (the module docstring's pipeline fill)."""
    n_units = len(work_j)
    n = np.arange(n_units + 1)
    most_work = np.concatenate([[0.0], np.cumsum(np.sort(work_j)[::-1])])  # n largest
    rest = np.concatenate([[0.0], np.cumsum(np.sort(least_work))])[n_units - n]  # U - n smallest
    fewest_weights = np.concatenate([[0.0], np.cumsum(np.sort(weights))])
    fewest_kv = np.concatenate([[0.0], np.cumsum(np.sort(kv))])
    free = memory_bytes - workspace_bytes - fewest_weights
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(fewest_kv > 0, np.floor(free / np.where(fewest_kv > 0, fewest_kv, 1.0)), math.inf)
        if max_micro_batches is not None:
            k = np.minimum(k, max_micro_batches)
        ceiling = np.where(np.isinf(k), 1.0, k * most_work / (rest + k * most_work))
    ceiling = np.where((k >= 1) & (free >= 0), np.minimum(np.nan_to_num(ceiling, nan=1.0), 1.0), 0.0)
    ceiling[0] = 0.0
    return ceiling


def concave_envelope(values: np.ndarray) -> list[tuple[float, float]]:
    """(intercept, slope) of the segments of the least concave function >= values[n] at n = 0..len-1."""
    hull: list[int] = []
    for n in range(len(values)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (values[b] - values[a]) * (n - a) <= (values[n] - values[a]) * (b - a):
                hull.pop()
            else:
                break
        hull.append(n)
    segments = []
    for a, b in zip(hull, hull[1:], strict=False):
        slope = (values[b] - values[a]) / (b - a)
        segments.append((values[a] - slope * a, slope))
    return segments or [(float(values[0]), 0.0)]


def _fill_rows(work, memory, workspace, weights, kv, max_micro_batches, a_block: int, z_block: int):
    """Per device column j and envelope segment: (columns, values, upper) of
    sum_u w_uj a_uj - slope * sum_u z_uj <= intercept (column blocks as in `memory_flow_bound`)."""
    n_units, n_devices = work.shape
    least_work = work.min(axis=1)
    for j in range(n_devices):
        ceiling = fill_ceiling(
            work[:, j], least_work, memory[j], workspace[j], weights, kv, max_micro_batches
        )
        cells = np.arange(n_units) * n_devices + j
        for intercept, slope in concave_envelope(ceiling):
            cols = np.concatenate([a_block + cells, z_block + cells])
            vals = np.concatenate([work[:, j], np.full(n_units, -slope)])
            yield cols, vals, intercept * (1 + LP_SLACK)
