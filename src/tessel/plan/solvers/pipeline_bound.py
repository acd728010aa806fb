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

Communication: every stage but the last sends a micro-batch's hidden states to the next, so S
carries at least (stages - 1) of the least send of a round (prefill + n_out decode steps) between
two devices. Classes are also split by network island (`tessel.plan.replicas.islands`): a pipeline
whose devices sit on r islands has at least r - 1 stages whose successor is on another island, each
paying at least the least send between islands, and its bottleneck W is at least that send. (With
`overlap` a stage's time is the max of compute and comm: no send is counted. When the islands would
make more than `MAX_COMPOSITIONS` compositions, classes ignore them and only the least send counts.)

The best plan is a set of whole pipelines using at most N_t devices of each class, so the integer
program max sum_c lambda_c UB(c), sum_c c_t lambda_c <= N_t, lambda >= 0 whole (with a cap on the
micro-batches in all, one column per (c, k) and sum k lambda <= cap) bounds it: the lesser of its
linear relaxation and its exact optimum without the cap (a knapsack over the devices left). Unlike
the per-device rows of `memory_bound` it knows that the fast devices one pipeline uses are not there
for another, and that a pipeline is not taken in fractions. First / last stage extras are left out
(they only lower a plan).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from tessel.plan.instance import PlanningInstance
from tessel.plan.replicas.islands import island_of
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
    sends = _Sends.of(relaxed, n_out)
    classes = _device_classes(work, free, sends.island)
    if not classes:
        return 0.0
    if math.prod(c + 1 for c in classes.values()) > MAX_COMPOSITIONS:  # islands merged: fewer classes
        sends = _Sends(sends.least_s, sends.least_s, [0] * len(sends.island))
        classes = _device_classes(work, free, sends.island)
    keys = sorted(classes)  # fastest first
    counts = [classes[key] for key in keys]
    if math.prod(c + 1 for c in counts) > MAX_COMPOSITIONS:
        return math.inf
    w_t = np.array([key[0] for key in keys])
    free_t = np.array([key[1] for key in keys])
    island_t = np.array([key[2] for key in keys])
    columns = []  # (composition, k, rounds per second)
    for composition in itertools.product(*(range(c + 1) for c in counts)):
        c = np.array(composition, dtype=float)
        if not c.any():
            continue
        send, least_bottleneck = sends.of_composition(c, island_t)
        for k, rate in _rates(
            c, w_t, free_t, weight, kv, relaxed.n_units, max_micro_batches, send, least_bottleneck
        ):
            columns.append((c, k, rate))
    if not columns:
        return 0.0
    cap = max_micro_batches if max_micro_batches is not None and max_micro_batches <= EXACT_K else None
    best = most_pipelines(
        columns, np.array(counts, dtype=float), cap
    )  # a larger cap left out only loosens it
    return micro_batch_size * n_out * best * (1 + LP_SLACK)


def _rates(c, w_t, free_t, weight, kv, n_units, cap, send: float = 0.0, least_bottleneck: float = 0.0):
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
        least = _least_round(c, w_t, _caps(free_t, weight, kv, ks), ks, n_units, send, least_bottleneck)
        return list(zip(ks.tolist(), (ks / least).tolist(), strict=True))
    grid = np.unique(np.concatenate([np.arange(1, min(k_most, EXACT_K) + 1), _geometric(EXACT_K, k_most)]))
    least = _least_round(c, w_t, _caps(free_t, weight, kv, grid), grid, n_units, send, least_bottleneck)
    ends = np.append(grid[1:] - 1, k_most)  # the last k each grid point stands for
    rates = ends / least
    i = int(np.argmax(rates))
    return [(int(ends[i]), float(rates[i]))]


def _device_classes(work, free, island) -> dict[tuple[float, float, int], int]:
    """Devices alike in per-unit work, free memory and network island, counted."""
    classes: dict[tuple[float, float, int], int] = {}
    for w, f, i in zip(work, free, island, strict=True):
        if math.isfinite(w) and f > 0:  # a device that runs no unit or holds nothing is no stage
            key = (float(w), float(f), int(i))
            classes[key] = classes.get(key, 0) + 1
    return classes


@dataclass(frozen=True, slots=True)
class _Sends:
    """What a pipeline's sends cost at least: every stage but the last sends one micro-batch's hidden
    states to the next (prefill + n_out decode steps per round), at least `least_s`; a pipeline on r
    network islands (`tessel.plan.replicas.islands`) has at least r - 1 stages whose successor sits
    on another island, each at least `crossing_s`, and such a stage's W is at least that send. With
    `overlap` a stage's time is the max of compute and comm, not the sum: no send is counted."""

    least_s: float
    crossing_s: float
    island: list[int]

    @classmethod
    def of(cls, instance: PlanningInstance, n_out: float) -> _Sends:
        n = instance.n_devices
        island = island_of(instance)
        if instance.overlap or n < 2:
            return cls(0.0, 0.0, island)
        round_s = np.asarray(instance.prefill.send_s, dtype=float) + n_out * np.asarray(
            instance.decode.send_s, dtype=float
        )
        apart = ~np.eye(n, dtype=bool)
        crossing = apart & ~np.equal.outer(island, island)
        least = float(np.min(round_s[apart]))
        across = float(np.min(round_s[crossing])) if crossing.any() else least
        return cls(max(least, 0.0), max(across, least, 0.0), island)

    def of_composition(self, c: np.ndarray, island_t: np.ndarray) -> tuple[float, float]:
        """(the least the sends add to S, the least bottleneck W they force) for composition c."""
        stages = float(np.sum(c))
        if stages < 2:
            return 0.0, 0.0
        islands = len(set(island_t[c > 0].tolist()))
        send = (stages - islands) * self.least_s + (islands - 1) * self.crossing_s
        return send, self.crossing_s if islands > 1 else self.least_s


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


def _least_round(
    c, w_t, caps, ks, n_units: int, send: float = 0.0, least_bottleneck: float = 0.0
) -> np.ndarray:
    """[K]: min over fractional layouts of S + (k - 1) M (module docstring), at the breakpoints in M:
    each class at its cap, the least M at which the fastest i classes alone cover the units, and the
    least bottleneck the sends allow; `send` (the least the composition's sends add to S) on top."""
    used = c > 0
    w, c, caps = w_t[used], c[used], caps[:, used]
    candidates = [caps * w[None, :]]
    for i in range(1, len(w) + 1):
        candidates.append(_cover_m(w[:i], c[:i], caps[:, :i], n_units)[:, None])
    if least_bottleneck > 0:
        candidates.append(np.full((caps.shape[0], 1), least_bottleneck))
    m = np.concatenate(candidates, axis=1)  # [K, breakpoints]
    total = _sum_at(w, c, caps, m, n_units) + send
    bottleneck = np.maximum(np.where(np.isfinite(m), m, 0.0), least_bottleneck)
    fill = (np.asarray(ks, dtype=float)[:, None] - 1) * bottleneck
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


def most_pipelines(columns, counts: np.ndarray, cap: int | None = None) -> float:
    """max sum_j rate_j x_j over columns (composition c_j, micro-batches k_j, rate_j) with
    sum_j c_jt x_j <= N_t (and sum_j k_j x_j <= cap): the lesser of the linear program's value and the
    best whole numbers of pipelines without the cap (`_whole_pipelines`); inf when the LP has no
    optimum."""
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
    relaxed = -float(h.getInfo().objective_function_value)
    return min(relaxed, _whole_pipelines(columns, counts))


def _whole_pipelines(columns, counts: np.ndarray) -> float:
    """The most summed rate of whole pipelines within the device counts, exactly: a knapsack over the
    vectors of devices left (prod (N_t + 1) states, no more than the compositions), each state the
    best of its compositions plus the state of the devices they leave (inf: too many states)."""
    shape = tuple(int(n) + 1 for n in counts)
    n_states = math.prod(shape)
    if n_states > MAX_COMPOSITIONS:
        return math.inf
    best_rate: dict[tuple[int, ...], float] = {}
    for c, _, rate in columns:
        key = tuple(int(x) for x in c)
        best_rate[key] = max(best_rate.get(key, 0.0), float(rate))
    comps = np.array(list(best_rate), dtype=int).reshape(-1, len(shape))
    rates = np.array(list(best_rate.values()))
    offsets = np.ravel_multi_index(comps.T, shape)  # the index is linear: idx(v - c) = idx(v) - idx(c)
    best = np.zeros(n_states)
    for i, v in enumerate(np.ndindex(*shape)):
        fits = np.all(comps <= np.array(v), axis=1)
        if fits.any():
            best[i] = max(best[i], float(np.max(rates[fits] + best[i - offsets[fits]])))
    return float(best[-1])
