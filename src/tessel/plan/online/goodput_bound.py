"""An upper bound on the goodput of every plan of disjoint pipelines under the online model's SLOs.

What the online model (`latency`) asks of a pipeline at micro-batch size b with k micro-batches and a
rate lambda meeting both SLOs, with D = max_j T^dec_j, S = sum_j T^dec_j, P = sum_j p_j (one mean
prompt's prefill on every stage), n = max(n_out, 1) and the cycle C (its mean TPOT):

- C >= S (a micro-batch crosses every stage each token), C >= k D / (1 - lambda P) (the bottleneck's
  form) and C <= the TPOT SLO;
- the seats keep up (`queueing.wait_quantile_s` is finite): lambda (n C + P) < k b;
- the p90 TTFT is at least C + P x prompt_p90 / prompt_mean, within the TTFT SLO;
- k micro-batches of KV fit in GPU memory beside the weights.

Hence, with tau the TPOT SLO:

    g1: lambda (n D / b + P) < 1                        (C >= k D / (1 - lambda P) in the seats' row)
    g2: lambda (D (n S + P) + b tau P) < b tau          (k <= tau (1 - lambda P) / D, C >= S)
    g3: lambda (n S + P) < b k_most                     (k at most what memory holds)

all falling in D, S and P and rising in k_most. A pipeline is a composition (c_t devices of class
t: same least unit decode time t_t, prefill time q_t and free memory) and a layout (N_t units on
class t, whole units, c_t <= N_t <= c_t cap_t, cap_t the units one device holds with one micro-batch
of KV); then S >= sum N_t t_t, P >= sum N_t q_t / b, D >= max_t ceil(N_t / c_t) t_t (some device holds
that many), and k_most <= the least over classes of what the device with ceil(N_t / c_t) units
holds. `lambda(c)` = the most of min(g1, g2, g3) over the layouts that meet S <= tau, D <= tau and
S + P x prompt_p90 / prompt_mean <= the TTFT SLO bounds every pipeline of composition c; the linear
program max sum_c lambda(c) x_c, sum_c c_t x_c <= N_t bounds every set of disjoint pipelines.

A second, coarser bound needs no compositions: with y_j = lambda n_j (unit crossings per second on
device j), sum_j y_j = U Lambda, the TPOT rows give sum_j y_j (t_j - tau / U) <= 0 and g1 gives
y_j <= b / (n t_j + q_j): a fractional knapsack (fast devices at their cap earn slack, slower ones
spend it, cheapest first). The bound is the lesser of the two, the most over the micro-batch sizes
given. Communication, the first / last stage extras, queueing waits and the residual R are left
out, which only loosens it. Held against an exhaustive search over every set of disjoint pipelines,
every split and every k on small instances (`tests/plan/test_online_bound.py`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from tessel.plan.instance import PlanningInstance
from tessel.plan.online.shape import OnlineShape
from tessel.plan.solution import FEASIBILITY_ATOL_BYTES, FEASIBILITY_RTOL
from tessel.plan.solvers.pipeline_bound import most_pipelines

MAX_LAYOUT_PAIRS = 20_000_000  # compositions x layouts beyond which only the knapsack bound is given
CHUNK = 128  # compositions priced at once
CAP_ROUNDING = 1e-9  # a quotient a rounding below a whole number still counts as that number
LP_SLACK = 1e-6


@dataclass(frozen=True, slots=True)
class GoodputBound:
    goodput_req_s: float  # the most over the micro-batch sizes (the lesser of the two bounds)
    micro_batch_size: int  # where it is reached
    by_b: dict[int, float]  # the bound at each micro-batch size
    knapsack_by_b: dict[int, float]  # the coarser bound alone
    compositions: bool  # whether the compositions bound was computed (else the knapsack's alone)


@dataclass(frozen=True, slots=True)
class _Classes:
    decode_s: np.ndarray  # [T] t_t
    prefill_s: np.ndarray  # [T] q_t (b prompts)
    free_bytes: np.ndarray  # [T]
    counts: np.ndarray  # [T]


def goodput_bound(
    instances: dict[int, PlanningInstance], shape: OnlineShape, slo: tuple[float, float]
) -> GoodputBound:
    """The bound over every plan at the micro-batch sizes of `instances` (each priced at its b, one
    micro-batch, GPU memory only), in requests/s."""
    by_b, knapsack, exact = {}, {}, True
    for b, instance in instances.items():
        knapsack[b] = knapsack_bound(instance, b, shape, slo[1])
        by_composition = compositions_bound(instance, b, shape, slo)
        exact = exact and math.isfinite(by_composition)
        by_b[b] = min(knapsack[b], by_composition)
    best = max(by_b, key=lambda b: by_b[b])
    return GoodputBound(by_b[best], best, by_b, knapsack, exact)


def knapsack_bound(instance: PlanningInstance, b: int, shape: OnlineShape, tpot_slo_s: float) -> float:
    """The coarser bound (module docstring) at one micro-batch size."""
    n_units = instance.n_units
    decode = np.min(np.asarray(instance.decode.unit_time_s, dtype=float), axis=0)  # t_j
    prefill = np.min(np.asarray(instance.prefill.unit_time_s, dtype=float), axis=0)  # q_j
    tokens = max(shape.output_mean_tokens, 1.0)
    usable = np.isfinite(decode) & np.isfinite(prefill) & (decode > 0)
    cap = np.where(usable, b / np.where(usable, tokens * decode + prefill, 1.0), 0.0)
    cost = decode - tpot_slo_s / n_units  # TPOT slack a crossing on j spends (< 0: earns)
    fast = usable & (cost <= 0)
    slack = float(np.sum(cap[fast] * -cost[fast]))
    crossings = float(np.sum(cap[fast]))
    for j in sorted(np.flatnonzero(usable & ~fast), key=lambda j: cost[j]):
        take = min(cap[j], slack / cost[j])
        crossings += take
        slack -= take * cost[j]
        if slack <= 0:
            break
    return crossings / n_units


def compositions_bound(
    instance: PlanningInstance, b: int, shape: OnlineShape, slo: tuple[float, float]
) -> float:
    """The compositions bound (module docstring) at one micro-batch size (inf: too many to price)."""
    classes = _classes(instance)
    if classes is None:
        return 0.0
    n_units = instance.n_units
    weight = float(np.min(instance.weight_bytes))
    kv = float(np.min(instance.kv_bytes)) / instance.micro_batches  # one micro-batch, one unit
    caps = np.floor(np.maximum(classes.free_bytes, 0.0) / (weight + kv) + CAP_ROUNDING)
    layouts = _layouts(n_units, len(classes.counts))
    compositions = np.array(
        [c for c in itertools.product(*(range(int(n) + 1) for n in classes.counts)) if any(c)], dtype=float
    )
    if len(compositions) * len(layouts) > MAX_LAYOUT_PAIRS:
        return math.inf
    rates = np.concatenate(
        [
            _composition_rates(compositions[i : i + CHUNK], layouts, classes, caps, weight, kv, b, shape, slo)
            for i in range(0, len(compositions), CHUNK)
        ]
    )
    keep = rates > 0
    if not keep.any():
        return 0.0
    columns = compositions[keep]
    value = most_pipelines([(c, 1, r) for c, r in zip(columns, rates[keep], strict=True)], classes.counts)
    return value * (1 + LP_SLACK)


def _classes(instance: PlanningInstance) -> _Classes | None:
    decode = np.min(np.asarray(instance.decode.unit_time_s, dtype=float), axis=0)
    prefill = np.min(np.asarray(instance.prefill.unit_time_s, dtype=float), axis=0)
    memory = np.array([d.memory_bytes for d in instance.devices]) * (1 + FEASIBILITY_RTOL)
    free = memory + FEASIBILITY_ATOL_BYTES - np.asarray(instance.workspace_bytes, dtype=float)
    found: dict[tuple[float, float, float], int] = {}
    for t, q, f in zip(decode, prefill, free, strict=True):
        if math.isfinite(t) and math.isfinite(q) and f > 0:
            key = (float(t), float(q), float(f))
            found[key] = found.get(key, 0) + 1
    if not found:
        return None
    keys = sorted(found)
    return _Classes(
        np.array([k[0] for k in keys]),
        np.array([k[1] for k in keys]),
        np.array([k[2] for k in keys]),
        np.array([found[k] for k in keys]),
    )


def _layouts(n_units: int, n_classes: int) -> np.ndarray:
    """[L, T]: every split of the units into n_classes counts (stars and bars)."""
    rows = []
    for bars in itertools.combinations(range(n_units + n_classes - 1), n_classes - 1):
        edges = (-1, *bars, n_units + n_classes - 1)
        rows.append([edges[i + 1] - edges[i] - 1 for i in range(n_classes)])
    return np.array(rows, dtype=float)


def _composition_rates(
    compositions, layouts, classes: _Classes, caps, weight, kv, b, shape, slo
) -> np.ndarray:  # noqa: ANN001
    """[C]: lambda(c) of each composition (0: no layout meets the SLOs)."""
    ttft_slo, tpot_slo = slo
    c = compositions[:, None, :]  # [C, 1, T]
    units = layouts[None, :, :]  # [1, L, T]
    used = c > 0
    valid = np.all(np.where(used, (units >= c) & (units <= c * caps), units == 0), axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        most = np.where(used, np.ceil(units / np.where(used, c, 1.0) - CAP_ROUNDING), 0.0)  # per device
        decode_max = np.max(most * classes.decode_s, axis=2)  # D
        decode_sum = np.sum(units * classes.decode_s, axis=2)  # S
        prompt = np.sum(units * classes.prefill_s, axis=2) / b  # P
        held = (np.maximum(classes.free_bytes, 0.0) / np.where(most > 0, most, 1.0) - weight) / kv
        k_most = np.min(np.where(most > 0, np.floor(held + CAP_ROUNDING), np.inf), axis=2) if kv > 0 else None
    ratio = shape.prompt_p90_tokens / shape.prompt_mean_tokens if shape.prompt_mean_tokens > 0 else 1.0
    ok = (
        valid
        & (decode_sum <= tpot_slo)
        & (decode_max <= tpot_slo)
        & (decode_sum + prompt * ratio <= ttft_slo)
    )
    tokens = max(shape.output_mean_tokens, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        g1 = 1.0 / (tokens * decode_max / b + prompt)
        g2 = b * tpot_slo / (decode_max * (tokens * decode_sum + prompt) + b * tpot_slo * prompt)
        rate = np.minimum(g1, g2)
        if k_most is not None:
            ok &= k_most >= 1
            rate = np.minimum(rate, b * k_most / (tokens * decode_sum + prompt))
    rate = np.where(ok & np.isfinite(rate), rate, 0.0)
    return np.max(rate, axis=1)
