"""The goodput bound of online plans (`tessel.plan.online.goodput_bound`) against an exhaustive search.

Oracle: on random tiny instances, every pipeline (every ordered selection of devices, every split of
the units, every k its memory holds up to `MOST_K`) priced by the online model (`latency.goodput_req_s`
on the stage times `evaluate` gives), then the best set of pairwise disjoint pipelines; both the
compositions bound and the coarser knapsack bound must be at least that."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plan.random_instances import random_instance
from tessel.plan.instance import subset, with_micro_batches
from tessel.plan.online.goodput_bound import compositions_bound, goodput_bound, knapsack_bound
from tessel.plan.online.latency import goodput_req_s, predict_p90
from tessel.plan.online.pipelines import most_micro_batches, times_of
from tessel.plan.online.shape import OnlineShape
from tessel.plan.solution import Solution, evaluate

RTOL = 1e-9
MOST_K = 12
B = 4  # the micro-batch size the instance stands for (its pass costs are a micro-batch's)


def _best_pipeline(instance, devices: tuple[int, ...], shape, slo) -> float:
    """The most goodput of any pipeline on exactly these devices (0: none meets the SLOs)."""
    one = with_micro_batches(subset(instance, devices), 1)
    best = 0.0
    for order in itertools.permutations(range(len(devices))):
        for cuts in itertools.combinations(range(1, instance.n_units), len(devices) - 1):
            counts = [b - a for a, b in zip((0, *cuts), (*cuts, instance.n_units), strict=True)]
            evaluation = evaluate(one, Solution.from_counts(order, counts))
            if not evaluation.feasible:
                continue
            for k in range(1, min(most_micro_batches(one, evaluation), MOST_K) + 1):
                times = times_of(evaluation, k, B)
                if predict_p90(times, shape, 0.0).tpot_p90_s > slo[1]:
                    break  # the TPOT at rate 0 only grows with k
                best = max(best, goodput_req_s(times, shape, *slo))
    return best


def exhaustive(instance, shape, slo) -> float:
    """The most summed goodput over every set of disjoint pipelines."""
    n = instance.n_devices
    alone = {
        mask: _best_pipeline(instance, tuple(j for j in range(n) if mask >> j & 1), shape, slo)
        for mask in range(1, 1 << n)
        if bin(mask).count("1") <= instance.n_units
    }
    best = [0.0] * (1 << n)
    for mask in range(1, 1 << n):
        sub = mask
        while sub:
            if sub in alone:
                best[mask] = max(best[mask], alone[sub] + best[mask ^ sub])
            sub = (sub - 1) & mask
    return best[(1 << n) - 1]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_units=st.integers(1, 4),
    n_devices=st.integers(1, 3),
    alike=st.booleans(),
    overlap=st.booleans(),
)
def test_the_goodput_bound_holds_against_every_set_of_disjoint_pipelines(
    seed, n_units, n_devices, alike, overlap
) -> None:
    rng = np.random.default_rng(seed)
    instance = random_instance(rng, n_units, n_devices, alike=alike, overlap=overlap)
    output = float(rng.uniform(2.0, 40.0))
    prompt = float(rng.uniform(20.0, 200.0))
    shape = OnlineShape(prompt, prompt * 1.4, output, 0.5, (output * 0.5, output, output * 1.5), 0.3)
    decode = float(np.mean(instance.decode.unit_time_s)) * n_units
    prefill = float(np.mean(instance.prefill.unit_time_s)) * n_units / B
    tpot = decode * float(rng.uniform(0.8, 6.0))
    ttft = (prefill + tpot) * float(rng.uniform(1.0, 20.0))
    slo = (ttft, tpot)
    found = exhaustive(instance, shape, slo)
    assert found <= knapsack_bound(instance, B, shape, tpot) * (1 + RTOL) + 1e-12
    assert found <= compositions_bound(instance, B, shape, slo) * (1 + RTOL) + 1e-12
    assert found <= goodput_bound({B: instance}, shape, slo).goodput_req_s * (1 + RTOL) + 1e-12


def test_whole_pipelines_count_where_fractions_would_not() -> None:
    """Three alike devices that each hold half the model: one pipeline at a time, of two or three of
    them. A linear program over compositions would take one and a half pipelines of two; whole
    pipelines give the third device nothing to add, and the exhaustive search stays within."""
    from dataclasses import replace

    rng = np.random.default_rng(3)
    instance = random_instance(rng, 4, 3, n_types=1, alike=True)
    weight, kv = float(instance.weight_bytes[0]), float(instance.kv_bytes[0]) / instance.micro_batches
    memory = (
        float(instance.workspace_bytes[0]) + instance.first_bytes + instance.last_bytes + 2.5 * (weight + kv)
    )
    devices = tuple(replace(d, memory_bytes=memory) for d in instance.devices)
    instance = replace(instance, devices=devices)
    shape = OnlineShape(100.0, 140.0, 10.0, 0.5, (5.0, 10.0, 15.0), 0.3)
    slo = (1e3, 10 * float(np.sum(instance.decode.unit_time_s[:, 0])))
    two = compositions_bound(subset(instance, (0, 1)), B, shape, slo)
    three = compositions_bound(instance, B, shape, slo)
    assert two > 0 and three < 1.4 * two
    assert exhaustive(instance, shape, slo) <= three * (1 + RTOL)
