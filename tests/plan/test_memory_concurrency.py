"""Concurrency set by memory: each replica carries as many micro-batches as its GPU memory holds.

Oracles: brute force over every partition of the devices, every count k of micro-batches per group
and every pipeline of each group (written out here, independent of the planner's search); the
memory bound (`tessel.plan.solvers.memory_bound`) against the same brute force; never worse than the whole
cluster as one pipeline at the workload's m."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plan.random_instances import random_instance
from plan.test_replicas import _oracle as brute_fixed_shares
from tessel.errors import TesselError
from tessel.plan.instance import subset
from tessel.plan.replicas.replica_baseline import separate_uniform
from tessel.plan.replicas.replicas import ReplicaSettings, choose_replicas
from tessel.plan.report import predict
from tessel.plan.solvers.brute import brute_force
from tessel.plan.solvers.memory_bound import memory_flow_bound
from tessel.plan.solvers.pipeline_bound import pipelines_bound_tok_s
from tessel.plan.solvers.solve import solve

RTOL = 1e-6
MOST_K = 6  # the instances below hold at most this many micro-batches on all devices together


def memory_instance(seed: int, n_units: int, n_devices: int, overlap: bool = False):
    """Random devices with host memory (which memory mode must not use), and KV so large that all
    devices together hold at most MOST_K micro-batches."""
    rng = np.random.default_rng(seed)
    instance = random_instance(rng, n_units, n_devices, overlap=overlap, offload=True)
    memory = sum(d.memory_bytes for d in instance.devices)
    spare = memory - float(instance.weight_bytes.sum()) - instance.first_bytes - instance.last_bytes
    per_mb = max(spare, memory * 0.05) / rng.uniform(1.5, MOST_K)  # KV of one micro-batch, all units
    share = rng.uniform(0.5, 1.5, size=n_units)
    kv_one = per_mb * share / share.sum()
    return replace(instance, kv_bytes=kv_one * instance.micro_batches)


def group_at(instance, group, k: int):
    """The model under test, written out: the group's devices without host memory, k micro-batches
    in flight and their KV."""
    sub = subset(instance, group)
    sub = replace(sub, devices=tuple(replace(d, host_bytes=0.0) for d in sub.devices))
    return replace(sub, micro_batches=k, kv_bytes=np.asarray(instance.kv_bytes) * k / instance.micro_batches)


def _labelings(n: int):
    def grow(prefix):
        if len(prefix) == n:
            yield prefix
            return
        for label in range(max(prefix, default=-1) + 2):
            yield from grow([*prefix, label])

    yield from grow([])


def brute_memory(instance, cap: int | None) -> float:
    """Most summed throughput over every partition, every k_g in 0..MOST_K per group (sum <= cap when
    given) and every pipeline of each group, all held in GPU memory."""
    best = 0.0
    cache: dict[tuple, list[float]] = {}
    for labels in _labelings(instance.n_devices):
        groups = [tuple(j for j, x in enumerate(labels) if x == label) for label in set(labels)]
        curves = []
        for g in groups:
            if g not in cache:
                curve = [0.0]
                for k in range(1, MOST_K + 1):
                    sub = group_at(instance, g, k)
                    found = brute_force(sub).evaluation
                    curve.append(0.0 if found is None else predict(sub, found, 1).throughput_tok_s)
                cache[g] = curve
            curves.append(cache[g])
        for ks in itertools.product(range(MOST_K + 1), repeat=len(groups)):
            if cap is None or sum(ks) <= cap:
                best = max(best, sum(c[k] for c, k in zip(curves, ks, strict=True)))
    return best


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_units=st.integers(1, 3),
    n_devices=st.integers(1, 4),
    cap=st.sampled_from([None, 1, 3]),
    overlap=st.booleans(),
)
def test_memory_concurrency_equals_brute_force_and_bound_holds(
    seed, n_units, n_devices, cap, overlap
) -> None:
    instance = memory_instance(seed, n_units, n_devices, overlap)
    expected = brute_memory(instance, cap)
    single = brute_force(instance).evaluation
    single_tok_s = 0.0 if single is None else predict(instance, single, 1).throughput_tok_s
    fixed = brute_fixed_shares(instance)  # the fixed shares of m (offloading allowed) are candidates
    if expected == 0.0 and single_tok_s == 0.0 and fixed == 0.0:
        with pytest.raises(TesselError):
            choose_replicas(
                instance, 1, ReplicaSettings(solver="brute", concurrency="memory", max_micro_batches=cap)
            )
        return
    chosen = choose_replicas(
        instance, 1, ReplicaSettings(solver="brute", concurrency="memory", max_micro_batches=cap)
    )
    # the best of memory splits, fixed-share splits and the whole cluster at the workload's m
    assert chosen.throughput_tok_s == pytest.approx(max(expected, single_tok_s, fixed), rel=RTOL)
    assert chosen.throughput_tok_s >= single_tok_s * (1 - RTOL)
    bound = memory_flow_bound(instance, 1, max_micro_batches=cap)
    assert expected <= bound.throughput_tok_s * (1 + RTOL)
    filled = memory_flow_bound(instance, 1, max_micro_batches=cap, pipelines=True)
    assert expected <= filled.throughput_tok_s * (1 + RTOL)  # the pipeline fill priced: still a bound
    assert filled.throughput_tok_s <= bound.throughput_tok_s * (1 + RTOL)
    assert expected <= pipelines_bound_tok_s(instance, 1, cap) * (1 + RTOL)  # by composition
    if chosen.throughput_tok_s > max(single_tok_s, fixed) * (1 + RTOL):  # a memory split won
        assert sum(r.throughput_tok_s for r in chosen.replicas) == pytest.approx(chosen.throughput_tok_s)
        if cap is not None:
            assert sum(r.micro_batches for r in chosen.replicas) <= cap
        for replica in chosen.replicas:
            assert replica.result.evaluation.feasible
            assert replica.result.evaluation.offload_bytes == 0.0
            assert replica.instance.micro_batches == replica.micro_batches
            tok_s = predict(replica.instance, replica.result.evaluation, 1).throughput_tok_s
            assert tok_s == pytest.approx(replica.throughput_tok_s, rel=RTOL)
        separate = separate_uniform(instance, 1, "memory", cap)
        if separate is not None:
            assert separate.throughput_tok_s <= chosen.throughput_tok_s * (1 + RTOL)


def test_memory_mode_carries_more_than_the_fixed_share() -> None:
    """Two devices that each hold the model and several micro-batches: fixed mode shares m = 2, memory
    mode lets each replica carry what its memory holds."""
    instance = memory_instance(3, 2, 2)
    fixed = choose_replicas(instance, 1, ReplicaSettings(solver="brute"))
    memory = choose_replicas(instance, 1, ReplicaSettings(solver="brute", concurrency="memory"))
    assert memory.throughput_tok_s >= fixed.throughput_tok_s * (1 - RTOL)
    assert memory.concurrency == "memory"


def test_never_worse_than_one_pipeline_on_a_larger_cluster() -> None:
    """Past the exhaustive size (candidate splits, short screening) the result still holds the whole
    cluster's pipeline at the workload's m as a candidate."""
    instance = random_instance(np.random.default_rng(11), 8, 9, n_types=3)
    single = solve(instance, solver="dp", time_limit_s=3)
    single_tok_s = predict(instance, single.evaluation, 2).throughput_tok_s
    for concurrency in ("fixed", "memory"):
        chosen = choose_replicas(
            instance, 2, ReplicaSettings(solver="dp", time_limit_s=6, concurrency=concurrency)
        )
        assert chosen.throughput_tok_s >= min(single_tok_s, chosen.single_tok_s) * (1 - RTOL)
        assert chosen.throughput_tok_s >= chosen.single_tok_s * (1 - RTOL)


def test_bad_concurrency_is_refused() -> None:
    instance = memory_instance(1, 2, 2)
    with pytest.raises(TesselError, match="unknown concurrency"):
        choose_replicas(instance, 1, ReplicaSettings(solver="brute", concurrency="lots"))
    with pytest.raises(TesselError, match=">= 1"):
        choose_replicas(
            instance, 1, ReplicaSettings(solver="brute", concurrency="memory", max_micro_batches=0)
        )


def test_a_layer_no_gpu_holds_is_named() -> None:
    instance = memory_instance(2, 4, 2)
    weights = np.asarray(instance.weight_bytes).copy()
    weights[2] = 10 * max(d.memory_bytes for d in instance.devices)
    instance = replace(instance, weight_bytes=weights)
    with pytest.raises(TesselError, match="layer 2"):
        choose_replicas(instance, 1, ReplicaSettings(solver="brute", concurrency="memory"))
    assert memory_flow_bound(instance, 1).throughput_tok_s == 0.0


def test_cli_memory_concurrency_writes_a_plan_the_runtime_reads(tmp_path) -> None:
    """An offline workload with --replicas auto plans by memory; the plan file's m is the replicas'
    micro-batches in all, and it loads (plan file and runtime reader)."""
    import subprocess
    import sys

    from tessel.pipeline.run_plan import load_run_plan
    from tessel.plan.files.plan_file import load_plan

    path = tmp_path / "memory.json"
    result = subprocess.run(
        [sys.executable, "-m", "tessel.cli", "plan", "--model", "llama-2-7b", "--cluster", "llmpq-t4-v100",
         "--workload", "offline-batch", "--replicas", "auto", "--time-limit", "6", "--json", str(path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "concurrency: memory" in result.stdout
    plan = load_plan(path)
    in_flight = sum(r.micro_batches for r in plan.replicas)
    assert plan.workload["m"] >= in_flight
    summed = sum(r.predicted.throughput_tok_s for r in plan.replicas)
    assert plan.predicted.throughput_tok_s == pytest.approx(summed)
    single = re.search(r"one pipeline at the workload's \d+ micro-batches: ([\d.]+) tok/s", result.stdout)
    assert single is not None and plan.predicted.throughput_tok_s >= float(single.group(1)) * (1 - 1e-3)
    for index in range(len(plan.replicas)):
        assert load_run_plan(path, replica=index).micro_batches == plan.replicas[index].micro_batches


@pytest.mark.parametrize("stages, k", [(1, 3), (2, 1), (4, 2), (5, 7)])
def test_fill_ceiling_is_the_formulas_busy_time_on_alike_devices(stages: int, k: int) -> None:
    """S alike devices of U / S units each, k micro-batches: a device is busy k / (S + k - 1) of the
    time under the pipeline formula, and the ceiling says exactly that."""
    from tessel.plan.solvers.memory_bound import concave_envelope, fill_ceiling

    units, per = 20, 20 // stages if 20 % stages == 0 else None
    if per is None:
        units, per = 4 * stages, 4
    work = np.full(units, 0.3)
    weights, kv = np.full(units, 2.0), np.full(units, 1.0)
    memory = per * 2.0 + k * per * 1.0 + 0.5  # room for k micro-batches beside its weights, no more
    ceiling = fill_ceiling(work, work, memory, 0.5, weights, kv, None)
    assert ceiling[per] == pytest.approx(k / (stages + k - 1))
    envelope = concave_envelope(ceiling)
    for n, value in enumerate(ceiling):
        assert min(a + b * n for a, b in envelope) >= value - 1e-12


@pytest.mark.parametrize("units_held, holds", [(2.5, False), (2.999, False), (3.0, True)])
def test_compositions_bound_counts_whole_units(units_held: float, holds: bool) -> None:
    """Two alike devices, 5 alike units, memory for `units_held` units with one micro-batch's KV: a
    device holds a whole number of units, so at 2.5 (or just under 3) no plan holds the model
    (2 + 2 < 5) and the bound is 0; at 3 it is positive."""
    rng = np.random.default_rng(7)
    instance = random_instance(rng, 5, 2, n_types=1, alike=True, micro_batches=1)
    per_unit = float(instance.weight_bytes[0] + instance.kv_bytes[0])
    workspace = np.asarray(instance.workspace_bytes, dtype=float)
    devices = tuple(
        replace(d, memory_bytes=workspace[j] + units_held * per_unit, host_bytes=0.0)
        for j, d in enumerate(instance.devices)
    )
    instance = replace(instance, devices=devices, first_bytes=0.0, last_bytes=0.0)
    bound = pipelines_bound_tok_s(instance, 1, 1)
    assert (bound > 0) == holds
    if not holds:
        assert brute_force(instance).solution is None  # the oracle: no pipeline holds the model


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_units=st.integers(1, 3),
    n_devices=st.integers(3, 4),
    cap=st.sampled_from([None, 2]),
    slow=st.sampled_from([20.0, 300.0]),
)
def test_compositions_bound_with_sends_and_islands_holds(seed, n_units, n_devices, cap, slow) -> None:
    """Every device on its own node, in two regions whose links are `slow` times slower between them:
    two network islands, so the bound charges each pipeline its least sends and a send between
    islands per island it adds. Still at least brute force over every split, every k and every
    pipeline of each group."""
    from tessel.plan.instance import PassCosts
    from tessel.plan.replicas.islands import network_islands

    instance = memory_instance(seed, n_units, n_devices)
    region = np.arange(n_devices) % 2
    devices = tuple(replace(d, node=f"r{region[j]}-n{j}") for j, d in enumerate(instance.devices))
    factor = np.where(np.equal.outer(region, region), 1.0, slow)

    def slowed(c: PassCosts) -> PassCosts:
        send = np.asarray(c.send_s)
        link = float(np.max(send)) * factor
        np.fill_diagonal(link, 0.0)
        return replace(c, send_s=link)

    instance = replace(
        instance, devices=devices, prefill=slowed(instance.prefill), decode=slowed(instance.decode)
    )
    assert len(network_islands(instance)) == 2
    assert brute_memory(instance, cap) <= pipelines_bound_tok_s(instance, 1, cap) * (1 + RTOL)
