"""Precision per layer: DP, MILP and solve() against brute force on random tiny instances; the
budget, the default budget, the quality indicators and their bad input."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plan.random_instances import flagged_instance, random_instance, with_precision_choice
from tessel.errors import TesselError
from tessel.plan.precision.precision import parse_precisions
from tessel.plan.solvers.brute import brute_force
from tessel.plan.solvers.dp import solve_dp
from tessel.plan.solvers.milp import solve_milp
from tessel.plan.solvers.solve import solve

RTOL = 1e-6
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= RTOL * max(abs(a), abs(b))


def _instance(seed: int, n_units: int, n_devices: int, flags: int, n_precisions: int):
    rng = np.random.default_rng(seed)
    base = flagged_instance(seed, n_units, n_devices, flags & 7, rng=rng)  # bits 8, 16: the precision flags
    return with_precision_choice(base, rng, n_precisions, budget=bool(flags & 8), theta=bool(flags & 16))


def _objective(result):
    return None if result.evaluation is None else result.evaluation.objective


@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1),
    n_units=st.integers(1, 4),
    n_devices=st.integers(1, 3),
    flags=st.integers(0, 31),
    n_precisions=st.integers(2, 3),
)
def test_dp_and_milp_equal_brute_force_with_precisions(seed, n_units, n_devices, flags, n_precisions) -> None:
    instance = _instance(seed, n_units, n_devices, flags, n_precisions)
    oracle = brute_force(instance)
    dp = solve_dp(instance, orders="all")
    milp = solve_milp(instance, mip_gap=0.0, time_limit_s=60)
    assert dp.exact
    assert _same(_objective(oracle), _objective(dp))
    assert _same(_objective(oracle), _objective(milp))
    for result in (dp, milp):
        if result.evaluation is not None:
            assert result.evaluation.feasible
            budget = instance.precision.quality_budget
            assert result.evaluation.quality <= budget * (1 + RTOL) + 1e-12
    if milp.evaluation is not None:
        assert _same(milp.objective, milp.evaluation.objective)  # HiGHS's model = evaluate's numbers


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), flags=st.integers(0, 31))
def test_solve_equals_brute_force_with_precisions(seed: int, flags: int) -> None:
    instance = _instance(seed, 3, 3, flags, 2)
    oracle = brute_force(instance)
    if oracle.solution is None:
        with pytest.raises(TesselError):
            solve(instance, time_limit_s=30, mip_gap=0.0)
        return
    result = solve(instance, time_limit_s=30, mip_gap=0.0)
    assert _same(result.evaluation.objective, oracle.evaluation.objective)


def test_precision_choice_can_only_help() -> None:
    """Allowing a second precision never makes the optimum worse than the reference alone."""
    for seed in range(4):
        instance = _instance(seed, 4, 2, 4, 2)
        with_choice = brute_force(instance).evaluation
        alone = brute_force(instance.fixed(None)).evaluation
        if alone is not None:
            assert with_choice is not None and with_choice.objective <= alone.objective * (1 + RTOL)


def test_unmeetable_budget_names_the_smallest_feasible_one() -> None:
    rng = np.random.default_rng(5)
    base = random_instance(rng, 4, 2, tight_memory=True)
    instance = with_precision_choice(base, rng, 3, budget=False, theta=False)
    # shrink GPU memory (no host memory) until the reference precision fits nowhere but a lower one does
    least = np.inf
    for scale in np.linspace(1.0, 0.2, 17):
        shrunk = replace(
            instance, devices=tuple(replace(d, memory_bytes=scale * d.memory_bytes) for d in instance.devices)
        )
        feasible = [
            shrunk.quality_cost(vector)
            for vector in itertools.product(range(3), repeat=4)
            if brute_force(shrunk.fixed(vector)).solution is not None
        ]
        if feasible and min(feasible) > 0:
            instance, least = shrunk, min(feasible)
            break
    assert np.isfinite(least)
    tight = replace(instance, precision=replace(instance.precision, quality_budget=0.5 * least))
    with pytest.raises(TesselError, match="smallest budget with a plan is") as error:
        solve(tight, time_limit_s=20)
    assert f"{least:.4g}" in str(error.value)


@pytest.mark.parametrize(
    "text,expected",
    [("fp16,int8", ("fp16", "int8")), ("int4, FP16 ,int8", ("fp16", "int8", "int4")), ("int8", ("int8",))],
)
def test_parse_precisions_orders_reference_first(text, expected) -> None:
    assert parse_precisions(text) == expected


@pytest.mark.parametrize("text", ["", "fp16,,int8", "fp16,int3", "int8,int8", " , "])
def test_parse_precisions_refuses_bad_lists(text) -> None:
    with pytest.raises(TesselError):
        parse_precisions(text)
