"""The bound over every replica split (`tessel.plan.replicas.replica_bound`) against brute force: every
partition of the devices, every group planned by brute force, never more throughput than the bound."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plan.random_instances import flagged_instance, with_precision_choice
from plan.test_replicas import best_over_partitions
from tessel.plan.replicas.replica_bound import split_upper_bound_tok_s
from tessel.plan.replicas.replicas import ReplicaSettings, choose_replicas
from tessel.plan.report import predict
from tessel.plan.solution import Solution, evaluate


def _plans(instance):
    """Every plan of an instance (every device order, unit split and precision vector), evaluated."""
    U, N = instance.n_units, instance.n_devices
    vectors = (
        [None] if instance.precision is None else itertools.product(range(instance.n_precisions), repeat=U)
    )
    for vector in vectors:
        for k in range(1, min(N, U) + 1):
            for cuts in itertools.combinations(range(1, U), k - 1):
                counts = [b - a for a, b in zip((0, *cuts), (*cuts, U), strict=True)]
                for devices in itertools.permutations(range(N), k):
                    yield evaluate(instance, Solution.from_counts(devices, counts).with_precisions(vector))


def _best_split_tok_s(instance, micro_batch_size: int) -> float:
    """Most summed throughput over every partition, each group at its most throughput over every plan
    (not only the objective's optimum: the bound must cover them all)."""

    def most_tok_s(sub) -> float:
        plans = (predict(sub, e, micro_batch_size).throughput_tok_s for e in _plans(sub) if e.feasible)
        return max(plans, default=0.0)

    return best_over_partitions(instance, most_tok_s)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_units=st.integers(1, 4),
    n_devices=st.integers(1, 4),
    flags=st.integers(0, 15),
    n_precisions=st.integers(1, 3),
    batch=st.integers(1, 5),
)
def test_no_split_beats_the_bound(seed, n_units, n_devices, flags, n_precisions, batch) -> None:
    rng = np.random.default_rng(seed)
    instance = flagged_instance(seed, n_units, n_devices, flags, rng=rng)
    if n_precisions > 1:
        instance = with_precision_choice(instance, rng, n_precisions, budget=bool(flags & 1), theta=False)
    bound = split_upper_bound_tok_s(instance, batch)
    best = _best_split_tok_s(instance, batch)
    assert best <= bound * (1 + 1e-9), (best, bound)
    if best > 0:
        assert math.isfinite(bound)


def test_one_device_without_offloading_is_tight() -> None:
    """One device that holds every unit in its memory: the bound is m b n_out / (m U w), the
    throughput when the pipeline's one stage does nothing but its units (no extras)."""
    from dataclasses import replace

    rng = np.random.default_rng(5)
    instance = flagged_instance(0, 3, 1, 0, rng=rng)
    instance = replace(
        instance,
        prefill=replace(instance.prefill, first_time_s=np.zeros(1), last_time_s=np.zeros(1)),
        decode=replace(instance.decode, first_time_s=np.zeros(1), last_time_s=np.zeros(1)),
        prefill_weight=1.0,
    )
    alike = replace(
        instance,
        prefill=replace(instance.prefill, unit_time_s=np.full((3, 1), 0.01)),
        decode=replace(instance.decode, unit_time_s=np.full((3, 1), 0.001)),
    )
    plan = Solution.from_counts([0], [3])
    evaluation = evaluate(alike, plan)
    assert evaluation.feasible and evaluation.offload_bytes == 0
    actual = predict(alike, evaluation, 2).throughput_tok_s
    assert split_upper_bound_tok_s(alike, 2) == pytest.approx(actual, rel=1e-9)


def _one_stage_instance(slowdowns: list[float], micro_batches: int):
    """3 units on devices that each hold all of them, no stage extras, unit time x slowdown."""
    from dataclasses import replace

    n = len(slowdowns)
    instance = flagged_instance(0, 3, n, 0, rng=np.random.default_rng(5), micro_batches=micro_batches)
    memory = float(instance.weight_bytes.sum() + instance.kv_bytes.sum()) * 4
    speed = np.array(slowdowns)[None, :]
    zeros = np.zeros(n)
    return replace(
        instance,
        devices=tuple(replace(d, memory_bytes=memory) for d in instance.devices),
        prefill=replace(instance.prefill, unit_time_s=0.01 * speed.repeat(3, 0), first_time_s=zeros,
                        last_time_s=zeros),
        decode=replace(instance.decode, unit_time_s=0.001 * speed.repeat(3, 0), first_time_s=zeros,
                       last_time_s=zeros),
        prefill_weight=1.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("slowdowns", "micro_batches", "fluid_over_best"),
    [
        ([1, 1, 1, 1], 2, 2.0),  # 2 one-device replicas, 1 micro-batch each; every device busy: 4
        ([1, 3, 3, 3], 2, 1.5),  # the fast device takes 1 micro-batch (1 stage), a slow one the other
    ],
)
def test_flow_bound_is_tight_where_requests_in_flight_limit(
    slowdowns, micro_batches, fluid_over_best
) -> None:
    """Too few micro-batches in flight to keep every device busy: the best split (brute force) is
    exactly the flow bound's, while the fluid bound (every device busy at once) is looser."""
    from tessel.plan.replicas.replica_bound import _fluid_bound_tok_s, flow_bound_tok_s

    instance = _one_stage_instance(slowdowns, micro_batches)
    best = _best_split_tok_s(instance, 2)
    assert flow_bound_tok_s(instance, 2) == pytest.approx(best, rel=1e-5)
    assert split_upper_bound_tok_s(instance, 2) == pytest.approx(best, rel=1e-5)
    assert _fluid_bound_tok_s(instance, 2) == pytest.approx(fluid_over_best * best, rel=1e-5)


def test_flow_bound_is_infinite_when_a_unit_costs_nothing() -> None:
    from tessel.plan.replicas.replica_bound import flow_bound_tok_s

    assert flow_bound_tok_s(_one_stage_instance([0, 1], 2), 2) == math.inf


def test_bound_covers_the_chosen_split_on_a_bundled_cluster() -> None:
    from tessel.plan.build import build_instance

    instance = build_instance("llama-2-7b", "llmpq-t4-v100", "default")
    chosen = choose_replicas(instance, 7, ReplicaSettings(solver="dp", time_limit_s=6))
    bound = split_upper_bound_tok_s(instance, 7)
    assert chosen.throughput_tok_s <= bound < math.inf


def test_a_share_of_the_kv_is_covered() -> None:
    """One device whose memory holds every unit with one micro-batch's KV but must offload the KV of
    all m: its best is at a share of one micro-batch (no offload), and the bound covers that (a
    bound that charged every replica the KV of all m micro-batches would fall below it)."""
    from dataclasses import replace

    rng = np.random.default_rng(11)
    instance = flagged_instance(0, 3, 1, 0, rng=rng, micro_batches=4)
    instance = replace(
        instance,
        prefill=replace(instance.prefill, first_time_s=np.zeros(1), last_time_s=np.zeros(1)),
        decode=replace(instance.decode, first_time_s=np.zeros(1), last_time_s=np.zeros(1)),
        kv_bytes=np.full(3, 4e9),
        weight_bytes=np.full(3, 1e9),
        first_bytes=0.0,
        last_bytes=0.0,
        workspace_bytes=np.zeros(1),
    )
    slot = replace(instance.devices[0], memory_bytes=7e9, host_bytes=1e12, host_to_device_bytes_per_s=1e8)
    instance = replace(instance, devices=(slot,))
    one = choose_replicas(instance, 2, ReplicaSettings(solver="brute"))
    assert [r.micro_batches for r in one.replicas] == [1]
    best = _best_split_tok_s(instance, 2)
    assert best == pytest.approx(one.throughput_tok_s, rel=1e-9)
    assert best <= split_upper_bound_tok_s(instance, 2) * (1 + 1e-9)
