"""The counts relaxation's lower bound against the brute-force optimum on fresh random instances."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plan.random_instances import flagged_instance, random_instance
from tessel.plan.solution import evaluate
from tessel.plan.solvers.bound import counts_search, plan_from_picks, units_alike
from tessel.plan.solvers.brute import brute_force

RTOL = 1e-9


def _instance(seed: int, n_units: int, n_devices: int, flags: int, alike: bool = True):
    return flagged_instance(seed, n_units, n_devices, flags & 15, alike=alike)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n_units=st.integers(1, 7),
    n_devices=st.integers(1, 4),
    flags=st.integers(0, 15),
    rel_gap=st.sampled_from([0.0, 0.01, 0.1]),
    offer_optimum=st.booleans(),
)
def test_bound_never_exceeds_the_optimum_and_its_plan_is_real(
    seed: int, n_units: int, n_devices: int, flags: int, rel_gap: float, offer_optimum: bool
) -> None:
    """Also with the optimum given as the incumbent, so the search skips the most slices."""
    instance = _instance(seed, n_units, n_devices, flags)
    assert units_alike(instance)
    brute = brute_force(instance)
    oracle = brute.evaluation
    incumbent = brute.solution if offer_optimum else None
    result = counts_search(instance, incumbent=incumbent, rel_gap=rel_gap, time_limit_s=30)
    if oracle is None:
        assert result.solution is None
        return
    assert result.bound <= oracle.objective * (1 + RTOL)
    if result.solution is not None:
        evaluation = evaluate(instance, result.solution)
        assert evaluation.feasible
        assert evaluation.objective >= oracle.objective * (1 - RTOL)
        assert result.bound <= evaluation.objective * (1 + RTOL)


def test_single_node_copies_make_the_relaxation_tight() -> None:
    """Same-type devices on one node with equal links: the relaxation prices a plan exactly, so the
    search proves its own plan optimal up to the bottleneck grid (0.1%)."""
    rng = np.random.default_rng(5)
    instance = random_instance(rng, 12, 4, n_types=2, micro_batches=4, alike=True)
    for device in instance.devices:
        object.__setattr__(device, "node", "one")
    for costs in (instance.prefill, instance.decode):
        costs.send_s[:] = np.where(np.eye(4, dtype=bool), 0.0, costs.send_s.max())
    oracle = brute_force(instance).evaluation.objective
    result = counts_search(instance, time_limit_s=30)
    assert result.evaluation.objective == oracle or abs(result.evaluation.objective - oracle) <= 1e-9 * oracle
    assert oracle * (1 - 2e-3) <= result.bound <= oracle * (1 + RTOL)


def test_units_that_differ_give_no_bound() -> None:
    instance = _instance(3, 5, 3, 0, alike=False)
    assert not units_alike(instance)
    result = counts_search(instance)
    assert result.bound == -np.inf and result.solution is None


def test_plan_from_picks_orders_first_and_last() -> None:
    instance = _instance(11, 6, 4, 0)
    # device 2 first (role index 3: first, leaves), device 0 middle, device 1 last (role 4)
    solution = plan_from_picks(instance, [(0, 0, 2), (1, 4, 2), (2, 3, 2)])
    assert solution.stages[0].device == 2 and solution.stages[-1].device == 1
    assert [stage.n_units for stage in solution.stages] == [2, 2, 2]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_units=st.integers(2, 7), n_devices=st.integers(2, 4))
def test_solve_keeps_its_proven_gap(seed: int, n_units: int, n_devices: int) -> None:
    """`solve` may stop on the counts bound alone: its plan is then within the gap of the optimum."""
    from tessel.errors import TesselError
    from tessel.plan.solvers.solve import solve

    instance = _instance(seed, n_units, n_devices, seed % 8)
    oracle = brute_force(instance).evaluation
    try:
        result = solve(instance, time_limit_s=20, mip_gap=0.01)
    except TesselError:
        assert oracle is None
        return
    assert oracle is not None and result.evaluation.feasible
    assert result.bound <= oracle.objective * (1 + RTOL)
    assert result.evaluation.objective <= oracle.objective * (1 + result.gap) * (1 + RTOL)
    assert result.gap <= 0.01 or result.status != "gap reached"
