"""Never slower for having more: a device added to a cluster never lowers the planned throughput,
never raises one request's latency or, priced by decode alone, its TPOT (the planner may leave the
new device idle). Oracle: the same planner on the cluster without that device."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plan.random_instances import flagged_instance
from plan.test_memory_concurrency import memory_instance
from tessel.errors import TesselError
from tessel.plan.instance import subset
from tessel.plan.replicas.replicas import ReplicaSettings, choose_replicas
from tessel.plan.solvers.solve import solve

RTOL = 1e-6  # HiGHS's own optimality tolerances


def _objective(instance, solver: str) -> float | None:
    try:
        return solve(instance, solver=solver, time_limit_s=30, mip_gap=0.0).evaluation.objective
    except TesselError:
        return None  # nothing fits


def _with_and_without(seed: int, n_units: int, n_devices: int, flags: int, one_stream: bool):
    instance = flagged_instance(seed, n_units, n_devices, flags & 15)
    if one_stream:
        instance = replace(instance, micro_batches=1, kv_bytes=instance.kv_bytes / instance.micro_batches)
    dropped = seed % n_devices
    kept = tuple(j for j in range(n_devices) if j != dropped)
    return instance, subset(instance, kept)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_units=st.integers(1, 6),
    n_devices=st.integers(2, 4),
    flags=st.integers(0, 15),
    one_stream=st.booleans(),
    solver=st.sampled_from(["milp", "dp"]),
)
def test_a_device_more_never_lowers_throughput(
    seed: int, n_units: int, n_devices: int, flags: int, one_stream: bool, solver: str
) -> None:
    """The objective is one round of m micro-batches (throughput = m b n_out / objective); with one
    stream in flight it is that request's latency, TTFT + n_out TPOT."""
    full, fewer = _with_and_without(seed, n_units, n_devices, flags, one_stream)
    without = _objective(fewer, solver)
    if without is None:
        return
    with_more = _objective(full, solver)
    assert with_more is not None, "a cluster that fits the model stops fitting with a device more"
    assert with_more <= without * (1 + RTOL)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_units=st.integers(1, 6), n_devices=st.integers(2, 4))
def test_a_device_more_never_raises_one_streams_tpot(seed: int, n_units: int, n_devices: int) -> None:
    """One stream priced by its decode steps alone: the planned TPOT never rises with a device more."""
    full, fewer = _with_and_without(seed, n_units, n_devices, seed % 8, one_stream=True)
    full, fewer = (replace(i, prefill_weight=0.0) for i in (full, fewer))
    without = _objective(fewer, "milp")
    if without is None:
        return
    with_more = solve(full, time_limit_s=30, mip_gap=0.0).evaluation
    assert with_more.decode_makespan_s <= without * (1 + RTOL)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_units=st.integers(1, 4),
    n_devices=st.integers(2, 4),
    concurrency=st.sampled_from(["fixed", "memory"]),
)
def test_a_device_more_never_lowers_replica_throughput(
    seed: int, n_units: int, n_devices: int, concurrency: str
) -> None:
    """`--replicas auto` (every partition of the devices, shares by knapsack or as memory holds,
    brute-force pipelines)."""
    if concurrency == "memory":
        full = memory_instance(seed, n_units, n_devices)
        fewer = subset(full, tuple(j for j in range(n_devices) if j != seed % n_devices))
    else:
        full, fewer = _with_and_without(seed, n_units, n_devices, seed % 8, one_stream=False)
    settings_ = ReplicaSettings(solver="brute", concurrency=concurrency)
    try:
        without = choose_replicas(fewer, 1, settings_).throughput_tok_s
    except TesselError:
        return
    with_more = choose_replicas(full, 1, settings_).throughput_tok_s
    assert with_more >= without * (1 - RTOL)
    assert np.isfinite(with_more)


def test_the_plan_names_the_devices_it_leaves_idle() -> None:
    from tessel.plan.report import idle_devices_line
    from tessel.plan.solution import Solution, evaluate

    instance = flagged_instance(1, 4, 3, 0)
    line = idle_devices_line(instance, evaluate(instance, Solution.from_counts([1], [4])))
    names = [device.name for device in instance.devices]
    assert line is not None and "2 of 3 GPUs" in line
    assert names[0] in line and names[2] in line and names[1] not in line
    everything = evaluate(instance, Solution.from_counts([0, 1, 2], [2, 1, 1]))
    assert idle_devices_line(instance, everything) is None
