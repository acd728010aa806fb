"""Helix's "separate pipelines" baseline: same-type groups, even layer splits, shared micro-batches.

Oracles: it is one particular split with particular (even) pipelines, so it can never beat the best
split with the best pipelines (brute force over every partition and every share, from
`test_replicas`); and on a cluster of one type where one GPU holds the model it is exactly the best
division of the micro-batches over single-GPU pipelines, written out here.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plan.random_instances import flagged_instance, random_instance
from plan.test_replicas import _oracle, group_share
from tessel.plan.instance import subset
from tessel.plan.replicas.replica_baseline import separate_uniform
from tessel.plan.report import predict
from tessel.plan.solvers.baselines import uniform


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_units=st.integers(1, 4),
    n_devices=st.integers(1, 4),
    flags=st.integers(0, 7),
)
def test_never_beats_the_best_split(seed, n_units, n_devices, flags) -> None:
    instance = flagged_instance(seed, n_units, n_devices, flags)
    found = separate_uniform(instance, 1)
    if found is None:
        return
    assert found.throughput_tok_s <= _oracle(instance) * (1 + 1e-9)
    assert sum(k for _, _, k in found.groups) <= instance.micro_batches
    types = {d.gpu_type for d in instance.devices}
    assert all(t in types and size >= 1 for t, size, _ in found.groups)


@pytest.mark.parametrize("seed", range(6))
def test_one_type_whose_gpus_each_hold_the_model(seed: int) -> None:
    instance = random_instance(np.random.default_rng(seed), 3, 3, n_types=1, alike=True, micro_batches=4)
    instance = _with_room(instance)
    found = separate_uniform(instance, 1)
    curve = [0.0]
    for k in range(1, instance.micro_batches + 1):  # any one GPU: all GPUs are alike
        part = group_share(subset(instance, (0,)), k)
        curve.append(predict(part, uniform(part).evaluation, 1).throughput_tok_s)
    best = max(
        sum(curve[k] for k in ks)
        for ks in itertools.product(range(instance.micro_batches + 1), repeat=instance.n_devices)
        if sum(ks) <= instance.micro_batches
    )
    assert found is not None
    assert found.throughput_tok_s == pytest.approx(best, rel=1e-9)
    assert all(size == 1 for _, size, _ in found.groups)


def _with_room(instance):
    """Every GPU holds the whole model with its KV (so the smallest group is one GPU)."""
    from dataclasses import replace

    need = float(np.sum(instance.weight_bytes) + np.sum(instance.kv_bytes)) + instance.first_bytes
    need += instance.last_bytes + float(np.max(instance.workspace_bytes))
    devices = tuple(replace(d, memory_bytes=int(2 * need)) for d in instance.devices)
    return replace(instance, devices=devices)
