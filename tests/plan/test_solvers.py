"""DP and MILP against the brute-force oracle on fresh random tiny instances, and their guarantees."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plan.random_instances import flagged_instance, random_instance
from tessel.plan.solution import Solution, evaluate
from tessel.plan.solvers.brute import brute_force, count_plans
from tessel.plan.solvers.dp import solve_dp
from tessel.plan.solvers.milp import solve_milp

RTOL = 1e-6
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _instance(seed: int, n_units: int, n_devices: int, flags: int):
    return flagged_instance(seed, n_units, n_devices, flags)


def _swap_in(flags: int) -> str:
    return "hidden" if flags & 8 else "charged"


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= RTOL * max(abs(a), abs(b))


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    n_units=st.integers(1, 6),
    n_devices=st.integers(1, 4),
    flags=st.integers(0, 31),
)
def test_dp_and_milp_equal_brute_force(seed: int, n_units: int, n_devices: int, flags: int) -> None:
    instance = _instance(seed, n_units, n_devices, flags)
    oracle = brute_force(instance)
    dp = solve_dp(instance, orders="all")
    milp = solve_milp(instance, mip_gap=0.0, time_limit_s=60)
    expected = None if oracle.evaluation is None else oracle.evaluation.objective
    assert dp.exact
    assert _same(expected, dp.evaluation and dp.evaluation.objective)
    assert _same(expected, milp.evaluation and milp.evaluation.objective)
    if milp.evaluation is not None:
        assert milp.evaluation.feasible and dp.evaluation.feasible
        assert _same(milp.objective, milp.evaluation.objective)  # HiGHS's model = evaluate's numbers


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_units=st.integers(2, 6), flags=st.integers(0, 15))
def test_type_orders_exact_over_type_contiguous_plans(seed: int, n_units: int, flags: int) -> None:
    """4 devices of 2 types (copies within a type): type orders are optimal among type-contiguous plans."""
    rng = np.random.default_rng(seed)
    instance = random_instance(
        rng,
        n_units,
        4,
        n_types=2,
        overlap=bool(flags & 1),
        offload=bool(flags & 2),
        tight_memory=bool(flags & 4),
        swap_in=_swap_in(flags),
    )
    # same-type devices sit on different nodes in the helper; node-blind links make them exact copies
    for costs in (instance.prefill, instance.decode):
        costs.send_s[:] = np.where(np.eye(4, dtype=bool), 0.0, costs.send_s.max())
    best = None
    for k in range(1, min(4, n_units) + 1):
        for cuts in itertools.combinations(range(1, n_units), k - 1):
            counts = [b - a for a, b in zip((0, *cuts), (*cuts, n_units), strict=True)]
            for devices in itertools.permutations(range(4), k):
                types = [instance.devices[j].gpu_type for j in devices]
                if any(types[i] != types[i + 1] and types[i] in types[i + 1 :] for i in range(k - 1)):
                    continue  # a type that comes back later: not type-contiguous
                ev = evaluate(instance, Solution.from_counts(devices, counts))
                if ev.feasible and (best is None or ev.objective < best):
                    best = ev.objective
    dp = solve_dp(instance, orders="types")
    assert dp.exact
    assert _same(best, dp.evaluation and dp.evaluation.objective)


def test_milp_warm_start_is_used_and_never_worse() -> None:
    rng = np.random.default_rng(7)
    instance = random_instance(rng, 9, 4, n_types=3, micro_batches=4)
    dp = solve_dp(instance, time_limit_s=20)
    milp = solve_milp(instance, time_limit_s=30, mip_gap=0.0, warm_start=dp.solution)
    assert milp.warm_started
    assert milp.evaluation.objective <= dp.evaluation.objective * (1 + RTOL)
    assert milp.bound <= milp.evaluation.objective * (1 + RTOL)


def test_dp_gap_mode_reports_a_valid_bound() -> None:
    rng = np.random.default_rng(11)
    instance = random_instance(rng, 6, 4, micro_batches=5)
    oracle = brute_force(instance).evaluation.objective
    dp = solve_dp(instance, orders="all", rel_gap=0.05)
    assert dp.bound <= oracle * (1 + RTOL)
    assert dp.evaluation.objective <= oracle * 1.05 * (1 + RTOL)


def test_milp_reports_infeasible_when_nothing_fits() -> None:
    rng = np.random.default_rng(3)
    instance = random_instance(rng, 5, 2)
    for device in instance.devices:
        object.__setattr__(device, "memory_bytes", 1.0)  # nothing fits, no host memory
    assert brute_force(instance).solution is None
    assert solve_dp(instance).solution is None
    result = solve_milp(instance, time_limit_s=30)
    assert result.solution is None and result.status == "Infeasible"


@pytest.mark.parametrize("n_units,n_devices", [(1, 1), (3, 2), (5, 3)])
def test_brute_force_counts_every_plan(n_units: int, n_devices: int) -> None:
    rng = np.random.default_rng(n_units * 10 + n_devices)
    instance = random_instance(rng, n_units, n_devices)
    assert brute_force(instance).plans_evaluated == count_plans(n_units, n_devices)


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    n_layers=st.integers(1, 4),
    n_devices=st.integers(1, 3),
    flags=st.integers(0, 15),
)
def test_sublayer_plans_never_worse_than_layer_plans(
    seed: int, n_layers: int, n_devices: int, flags: int
) -> None:
    """The same model at both granularities: a layer plan is a sublayer plan, so the optimum can only drop."""
    rng = np.random.default_rng(seed)
    fine = random_instance(
        rng,
        2 * n_layers,
        n_devices,
        overlap=bool(flags & 1),
        offload=bool(flags & 2),
        tight_memory=bool(flags & 4),
        granularity="sublayer",
        swap_in=_swap_in(flags),
    )
    coarse = _merge_layers(fine)
    best_fine = brute_force(fine).evaluation
    best_coarse = brute_force(coarse).evaluation
    dp_fine = solve_dp(fine, orders="all").evaluation
    if best_coarse is None:
        return
    assert best_fine is not None and dp_fine is not None
    assert best_fine.objective <= best_coarse.objective * (1 + RTOL)
    assert _same(dp_fine.objective, best_fine.objective)
    # the layer plan, read at unit level, evaluates to the same objective on the sublayer instance
    from tessel.plan.solution import Stage

    as_units = Solution(
        tuple(Stage(s.device, 2 * s.unit_start, 2 * s.unit_end) for s in brute_force(coarse).solution.stages)
    )
    assert _same(evaluate(fine, as_units).objective, best_coarse.objective)


def _merge_layers(instance):
    """The layer-granularity instance of a sublayer one: sum each layer's two units."""
    from tessel.plan.instance import PassCosts, PlanningInstance, Unit

    def pair_sum(a):
        return a.reshape(a.shape[0] // 2, 2, *a.shape[1:]).sum(axis=1)

    def merged(costs):
        return PassCosts(pair_sum(costs.unit_time_s), costs.first_time_s, costs.last_time_s, costs.send_s)

    return PlanningInstance(
        units=tuple(Unit(i) for i in range(instance.n_units // 2)),
        devices=instance.devices,
        prefill=merged(instance.prefill),
        decode=merged(instance.decode),
        weight_bytes=pair_sum(instance.weight_bytes),
        kv_bytes=pair_sum(instance.kv_bytes),
        workspace_bytes=instance.workspace_bytes,
        first_bytes=instance.first_bytes,
        last_bytes=instance.last_bytes,
        micro_batches=instance.micro_batches,
        prefill_weight=instance.prefill_weight,
        decode_weight=instance.decode_weight,
        overlap=instance.overlap,
        swap_in=instance.swap_in,
    )
