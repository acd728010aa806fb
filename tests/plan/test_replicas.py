"""Replicas: the chosen split against brute force over device partitions and over every division
of the workload's in-flight micro-batches among the groups (brute-force pipelines per group and
share), routing weights, and too many replicas."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plan.random_instances import flagged_instance, random_instance
from tessel.errors import TesselError
from tessel.plan.instance import subset
from tessel.plan.replicas.replicas import ReplicaSettings, choose_replicas, routing_weights
from tessel.plan.report import predict
from tessel.plan.solvers.brute import brute_force

RTOL = 1e-6


def _labelings(n: int):
    """Every partition of range(n), as restricted-growth label lists (independent of the planner's)."""

    def grow(prefix: list[int]):
        if len(prefix) == n:
            yield prefix
            return
        for label in range(max(prefix, default=-1) + 2):
            yield from grow([*prefix, label])

    yield from grow([])


def group_share(sub, k: int):
    """The model under test, written out here: a group holding k of the m micro-batches in flight
    plans with k micro-batches and the KV of those k only."""
    return replace(sub, micro_batches=k, kv_bytes=np.asarray(sub.kv_bytes) * k / sub.micro_batches)


def best_over_partitions(instance, group_tok_s) -> float:
    """Most summed `group_tok_s(group's sub-instance at its share)` over every partition of the
    devices into groups and every division of the m micro-batches into shares k_g >= 0 (0: idle),
    sum k_g <= m."""
    m, best = instance.micro_batches, 0.0
    for labels in _labelings(instance.n_devices):
        groups = [tuple(j for j, x in enumerate(labels) if x == label) for label in set(labels)]
        shares = range(1, m + 1)
        curves = [[0.0, *(group_tok_s(group_share(subset(instance, g), k)) for k in shares)] for g in groups]
        for ks in itertools.product(range(m + 1), repeat=len(groups)):
            if sum(ks) <= m:
                best = max(best, sum(curve[k] for curve, k in zip(curves, ks, strict=True)))
    return best


def _brute_force_tok_s(sub) -> float:
    found = brute_force(sub).evaluation
    return 0.0 if found is None else predict(sub, found, 1).throughput_tok_s


def _oracle(instance) -> float:
    return best_over_partitions(instance, _brute_force_tok_s)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_units=st.integers(1, 4),
    n_devices=st.integers(1, 4),
    flags=st.integers(0, 7),
)
def test_chosen_split_equals_brute_force_over_partitions(seed, n_units, n_devices, flags) -> None:
    instance = flagged_instance(seed, n_units, n_devices, flags)
    expected = _oracle(instance)
    if expected == 0.0:
        with pytest.raises(TesselError):
            choose_replicas(instance, 1, ReplicaSettings(solver="brute"))
        return
    chosen = choose_replicas(instance, 1, ReplicaSettings(solver="brute"))
    assert chosen.exhaustive
    assert chosen.throughput_tok_s == pytest.approx(expected, rel=RTOL)
    weights = [r.weight for r in chosen.replicas]
    assert sum(weights) == pytest.approx(1.0)
    for replica in chosen.replicas:
        assert replica.weight == pytest.approx(replica.throughput_tok_s / chosen.throughput_tok_s)
        used = {replica.devices[s.device] for s in replica.result.solution.stages}
        assert used <= set(replica.devices)
        assert replica.instance.micro_batches == replica.micro_batches >= 1
        expected_kv = instance.kv_bytes * replica.micro_batches / instance.micro_batches
        np.testing.assert_allclose(replica.instance.kv_bytes, expected_kv)
    devices = [j for r in chosen.replicas for j in r.devices]
    assert len(devices) == len(set(devices))  # disjoint
    # the cluster holds the workload's in-flight requests once, not once per replica
    assert sum(r.micro_batches for r in chosen.replicas) <= instance.micro_batches


def test_routing_weights_are_proportional_to_capacity() -> None:
    weights = routing_weights([3.0, 1.0, 0.5, 0.5])
    assert weights == pytest.approx([0.6, 0.2, 0.1, 0.1])
    with pytest.raises(ValueError):
        routing_weights([0.0])


def test_too_many_replicas_names_the_largest_feasible_count() -> None:
    rng = np.random.default_rng(4)
    instance = random_instance(rng, 3, 4)
    largest = max(  # every replica needs at least one of the m micro-batches in flight
        min(
            instance.micro_batches,
            sum(
                brute_force(
                    group_share(subset(instance, tuple(j for j, x in enumerate(labels) if x == label)), 1)
                ).solution
                is not None
                for label in set(labels)
            ),
        )
        for labels in _labelings(4)
    )
    with pytest.raises(TesselError, match="largest feasible count tessel found is"):
        choose_replicas(instance, 1, ReplicaSettings(replicas=5, solver="brute"))
    assert largest < 5
    with pytest.raises(TesselError, match=f"largest feasible count tessel found is {largest}"):
        choose_replicas(instance, 1, ReplicaSettings(replicas=largest + 1, solver="brute"))
    fixed = choose_replicas(instance, 1, ReplicaSettings(replicas=largest, solver="brute"))
    assert len(fixed.replicas) == largest
