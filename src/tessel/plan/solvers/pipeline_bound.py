"""An upper bound on the summed throughput of disjoint pipelines served by memory, by composition.

Plans covered: those of `tessel.plan.solvers.memory_bound` made of disjoint pipelines (replicas by
memory, flow plans whose paths share no GPU). A pipeline G with k micro-batches in flight serves
x_G = k / R_G micro-batch rounds per second, R_G >= S_G + (k - 1) M_G (S the sum of its stages'
W_j = T^pre_j + n_out T^dec_j, M their max), every stage holding its units' weights and the KV of
the k micro-batches in GPU memory.

Relax each unit to the least work, weight bytes and KV of any unit (so every plan stays a plan),
group devices into classes (same per-unit work w_t and free memory) and let a pipeline's layout be
fractional: a device of class t holds n_t <= cap_t(k) = floor(free_t / (weights + k kv)) units,
the same on every device of its class (spreading evenly leaves S and lowers M). For a composition
c (c_t devices of class t) and k, the least S + (k - 1) M over layouts with sum_t c_t n_t = U is
piecewise linear in the bottleneck M (fill the fastest classes first up to min(cap_t, M / w_t)), so
its minimum sits at a breakpoint: a class reaching its cap, a prefix of classes covering U alone,
or the least M that covers U. UB(c) = max_k k / that minimum bounds every pipeline of composition c.

The best plan is a set of pipelines using at most N_t devices of each class, so the linear program
max sum_c lambda_c UB(c), sum_c c_t lambda_c <= N_t, lambda >= 0 (with a cap on the micro-batches in
all, one column per (c, k) and sum k lambda <= cap) bounds it. Unlike the per-device rows of
`memory_bound` it knows that the fast devices one pipeline uses are not there for another.
Communication, first / last stage extras and whole layers are left out (they only lower a plan).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import FEASIBILITY_ATOL_BYTES, FEASIBILITY_RTOL
from tessel.plan.solvers.highs import highs_lp, new_highs

MAX_COMPOSITIONS = 5_000  # beyond this many device-class compositions (~0.4 ms each) no bound (inf)
LP_SLACK = 1e-6
MOST_K = 1024  # MAX_MICRO_BATCHES of a workload file: no pipeline holds more micro-batches
EXACT_K = 64  # every k up to here; beyond, a geometric grid whose gaps are bounded from above
K_GRID_RATIO = 0.01
CAP_ROUNDING = 1e-9  # a quotient a rounding below a whole number still counts as that number


def pipelines_bound_tok_s(
    instance: PlanningInstance, micro_batch_size: int, max_micro_batches: int | None = None
) -> float:
    """The module docstring's bound in tokens/s (inf: too many compositions or an LP failure;
    0: no pipeline holds the model)."""
    relaxed = instance.relaxed()
    n_out = relaxed.decode_weight / relaxed.prefill_weight
    work = (relaxed.prefill.unit_time_s + n_out * relaxed.decode.unit_time_s).min(axis=0)  # [N]
    weight = float(np.min(relaxed.weight_bytes))
    kv = float(np.min(relaxed.kv_bytes)) / relaxed.micro_batches  # one micro-batch, one unit
    memory = np.array([d.memory_bytes for d in relaxed.devices]) * (1 + FEASIBILITY_RTOL)
    free = memory + FEASIBILITY_ATOL_BYTES - np.asarray(relaxed.workspace_bytes, dtype=float)
    if np.any(work <= 0):
        return math.inf
    classes: dict[tuple[float, float], int] = {}
    for w, f in zip(work, free, strict=True):
        if math.isfinite(w) and f > 0:  # a device that runs no unit or holds nothing is no stage
            classes[(float(w), float(f))] = classes.get((float(w), float(f)), 0) + 1
    if not classes:
        return 0.0
    keys = sorted(classes)  # fastest first
    counts = [classes[key] for key in keys]
    if math.prod(c + 1 for c in counts) > MAX_COMPOSITIONS:
        return math.inf
    w_t = np.array([key[0] for key in keys])
    free_t = np.array([key[1] for key in keys])
    columns = []  # (composition, k, rounds per second)
    for composition in itertools.product(*(range(c + 1) for c in counts)):
        c = np.array(composition, dtype=float)
        if not c.any():
            continue
        for k, rate in _rates(c, w_t, free_t, weight, kv, relaxed.n_units, max_micro_batches):
            columns.append((c, k, rate))
    if not columns:
        return 0.0
    cap = max_micro_batches if max_micro_batches is not None and max_micro_batches <= EXACT_K else None
    best = _lp(columns, np.array(counts, dtype=float), cap)  # a larger cap left out only loosens it
    return micro_batch_size * n_out * best * (1 + LP_SLACK)


def _rates(c, w_t, free_t, weight, kv, n_units, cap):
    """(k, most rounds per second of a pipeline of composition c with k micro-batches): one column
    per k when the micro-batches in all are capped (at most `EXACT_K`), else one column bounding
    every k. Between grid points k_i < k_(i+1) the rate is at most (k_(i+1) - 1) / f(k_i): f only
    grows with k (more KV, smaller caps, a larger (k - 1) M)."""
    k_most = _most_k(c, free_t, weight, kv, n_units)
    exact = cap is not None and cap <= EXACT_K
    if exact:
        k_most = min(k_most, cap)
    if k_most < 1:
        return []
    if exact:
        ks = np.arange(1, k_most + 1)
        least = _least_round(c, w_t, _caps(free_t, weight, kv, ks), ks, n_units)
        return list(zip(ks.tolist(), (ks / least).tolist(), strict=True))
    grid = np.unique(np.concatenate([np.arange(1, min(k_most, EXACT_K) + 1), _geometric(EXACT_K, k_most)]))
    least = _least_round(c, w_t, _caps(free_t, weight, kv, grid), grid, n_units)
    ends = np.append(grid[1:] - 1, k_most)  # the last k each grid point stands for
    rates = ends / least
    i = int(np.argmax(rates))
    return [(int(ends[i]), float(rates[i]))]


def _geometric(start: int, stop: int) -> np.ndarray:
    if stop <= start:
        return np.array([], dtype=int)
    steps = math.ceil(math.log(stop / start) / math.log1p(K_GRID_RATIO))
    return np.unique(np.minimum(np.ceil(start * (1 + K_GRID_RATIO) ** np.arange(steps + 1)), stop)).astype(
        int
    )


def _caps(free_t, weight, kv, k) -> np.ndarray:
    """[K, T]: whole units one device of each class holds beside k micro-batches of their KV. A device
    holds a whole number of units, so the class's average (the layout's n_t) is at most the floor."""
    k = np.atleast_1d(np.asarray(k, dtype=float))
    return np.floor(np.maximum(free_t, 0.0)[None, :] / (weight + k[:, None] * kv) + CAP_ROUNDING)


def _most_k(c, free_t, weight, kv, n_units) -> int:
    """The most micro-batches with which the composition still holds every unit (0: none)."""
    if float(np.sum(c * _caps(free_t, weight, kv, 1)[0])) < n_units:
        return 0
    if kv <= 0:
        return MOST_K
    lo, hi = 1, MOST_K
    while lo < hi:  # the largest k whose caps still cover the units (caps fall with k)
        mid = (lo + hi + 1) // 2
        if float(np.sum(c * _caps(free_t, weight, kv, mid)[0])) >= n_units:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _least_round(c, w_t, caps, ks, n_units: int) -> np.ndarray:
    """[K]: min over fractional layouts of S + (k - 1) M (module docstring), at the breakpoints in M:
    each class at its cap, and the least M at which the fastest i classes alone cover the units."""
    used = c > 0
    w, c, caps = w_t[used], c[used], caps[:, used]
    candidates = [caps * w[None, :]]
    for i in range(1, len(w) + 1):
        candidates.append(_cover_m(w[:i], c[:i], caps[:, :i], n_units)[:, None])
    m = np.concatenate(candidates, axis=1)  # [K, breakpoints]
    total = _sum_at(w, c, caps, m, n_units)
    fill = (np.asarray(ks, dtype=float)[:, None] - 1) * np.where(np.isfinite(m), m, 0.0)
    return np.min(total + fill, axis=1)  # total is inf wherever m is


def _cover_m(w, c, caps, n_units: int) -> np.ndarray:
    """[K]: the least M at which these classes alone hold n_units (inf where they never do).
    held(M) = sum c min(cap, M / w) is linear between the classes' cap loads cap w: find the first
    such breakpoint that holds enough and interpolate from the one before."""
    rows = np.arange(caps.shape[0])
    loads = np.sort(caps * w[None, :], axis=1)  # [K, T] breakpoints
    held = np.sum(c * np.minimum(caps[:, None, :], loads[:, :, None] / w), axis=2)  # held at each
    enough = held[:, -1] >= n_units
    first = np.argmax(held >= n_units, axis=1)
    before = np.where(first > 0, loads[rows, np.maximum(first - 1, 0)], 0.0)
    held_before = np.where(first > 0, held[rows, np.maximum(first - 1, 0)], 0.0)
    slope = np.sum(np.where(caps * w[None, :] > before[:, None], c / w, 0.0), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        m = before + (n_units - held_before) / slope
    return np.where(enough, np.minimum(m, loads[rows, first]), np.inf)


def _sum_at(w, c, caps, m, n_units: int) -> np.ndarray:
    """[K, B]: least S with every device's load at most m, the fastest classes filled first (inf:
    the units do not fit under m)."""
    left = np.full(m.shape, float(n_units))
    total = np.zeros(m.shape)
    with np.errstate(invalid="ignore"):
        for t in range(len(w)):
            take = np.minimum(c[t] * np.minimum(caps[:, t : t + 1], m / w[t]), left)
            total += take * w[t]
            left -= take
    return np.where((left <= 1e-9 * n_units) & np.isfinite(m), total, np.inf)


def _lp(columns, counts: np.ndarray, cap: int | None) -> float:
    import highspy

    n_cols, n_classes = len(columns), len(counts)
    rows, cols, vals = [], [], []
    for j, (c, k, _) in enumerate(columns):
        for t in np.flatnonzero(c):
            rows.append(int(t))
            cols.append(j)
            vals.append(float(c[t]))
        if cap is not None:
            rows.append(n_classes)
            cols.append(j)
            vals.append(float(k))
    upper = list(counts) + ([float(cap)] if cap is not None else [])
    lp = highs_lp(
        -np.array([rate for _, _, rate in columns]),
        np.zeros(n_cols),
        np.full(n_cols, np.inf),
        np.array(rows),
        np.array(cols),
        np.array(vals),
        np.full(len(upper), -np.inf),
        np.array(upper),
    )
    h = new_highs()
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return math.inf
    return -float(h.getInfo().objective_function_value)
