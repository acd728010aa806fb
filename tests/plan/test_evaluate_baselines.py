"""`evaluate` against hand-computed numbers, and the baselines' shapes and infeasibility reports."""

from __future__ import annotations

import numpy as np
import pytest

from plan.random_instances import GIB, random_instance
from tessel.plan.instance import DeviceSlot, PassCosts, PlanningInstance, Unit
from tessel.plan.solution import Solution, Stage, evaluate
from tessel.plan.solvers.baselines import proportional_counts, run_baselines, vllm_uniform_counts


def _two_device_instance(
    overlap: bool, memory_gib: float = 10.0, host_gib: float = 0.0, swap_in: str = "charged"
) -> PlanningInstance:
    def costs(scale: float) -> PassCosts:
        return PassCosts(
            unit_time_s=np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]) * scale,
            first_time_s=np.array([0.5, 0.25]) * scale,
            last_time_s=np.array([0.125, 0.75]) * scale,
            send_s=np.array([[0.0, 0.3], [0.7, 0.0]]) * scale,
        )

    devices = tuple(
        DeviceSlot(f"n/gpu{j}", "X", "n", memory_gib * GIB, host_gib * GIB, 2.0 * GIB) for j in range(2)
    )
    return PlanningInstance(
        units=tuple(Unit(i) for i in range(3)),
        devices=devices,
        prefill=costs(1.0),
        decode=costs(0.01),
        weight_bytes=np.array([1.0, 2.0, 3.0]) * GIB,
        kv_bytes=np.array([0.5, 0.5, 0.5]) * GIB,
        workspace_bytes=np.array([0.25, 0.5]) * GIB,
        first_bytes=1.0 * GIB,
        last_bytes=2.0 * GIB,
        micro_batches=3,
        prefill_weight=1.0,
        decode_weight=10.0,
        overlap=overlap,
        swap_in=swap_in,
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_evaluate_matches_hand_computation(overlap: bool) -> None:
    instance = _two_device_instance(overlap)
    # device 1 runs unit 0 (first stage), device 0 runs units 1..2 (last stage)
    ev = evaluate(instance, Solution((Stage(1, 0, 1), Stage(0, 1, 3))))
    # prefill: stage 0 = 2 + 0.25 (first) + send 1->0 = 0.7; stage 1 = 3 + 5 + 0.125 (last)
    pre = [max(2.25, 0.7) if overlap else 2.25 + 0.7, 8.125]
    dec = [t * 0.01 for t in pre]
    assert [s.time_prefill_s for s in ev.stages] == pytest.approx(pre)
    assert [s.time_decode_s for s in ev.stages] == pytest.approx(dec)
    assert ev.prefill_makespan_s == pytest.approx(sum(pre) + 2 * max(pre))
    assert ev.objective == pytest.approx(sum(pre) + 2 * max(pre) + 10.0 * (sum(dec) + 2 * max(dec)))
    # held: stage 0 = 1 + 0.5 + 0.5 (ws of device 1) + 1 (embedding); stage 1 = 5 + 1 + 0.25 + 2 (LM head)
    assert [s.held_bytes / GIB for s in ev.stages] == pytest.approx([3.0, 8.25])
    assert ev.feasible and ev.offload_bytes == 0


def test_offloading_limits_and_swap_in_rule() -> None:
    # 7 GiB of memory: the last stage (8.25 GiB) offloads 1.25 GiB at 2 GiB/s = 0.625 s
    instance = _two_device_instance(False, memory_gib=7.0, host_gib=0.0)
    plan = Solution((Stage(1, 0, 1), Stage(0, 1, 3)))
    ev = evaluate(instance, plan)
    assert not ev.feasible and "host memory" in ev.reasons[0]
    for swap_in in ("charged", "hidden"):
        instance = _two_device_instance(False, memory_gib=7.0, host_gib=4.0, swap_in=swap_in)
        ev = evaluate(instance, plan)
        assert ev.stages[1].offload_bytes == pytest.approx(1.25 * GIB)
        assert ev.stages[1].offload_s == pytest.approx(0.625)
        assert ev.stages[1].time_prefill_s == pytest.approx(8.125 + 0.625)
        assert ev.stages[1].time_decode_s == pytest.approx(0.08125 + 0.625)  # streamed on every step
        single = evaluate(instance, Solution((Stage(0, 0, 3),)))
        if swap_in == "charged":
            assert ev.feasible and single.feasible
            continue
        # the upstream stage works 2.95 s in prefill but only 0.0295 s in a decode step: swap-in not hidden
        assert not ev.feasible and "swap-in" in ev.reasons[0]
        # the first stage may never offload
        assert not single.feasible and "first stage" in single.reasons[0]


def test_solution_validation() -> None:
    instance = _two_device_instance(False)
    for bad in ((Stage(0, 0, 2),), (Stage(0, 0, 1), Stage(0, 1, 3)), (Stage(0, 0, 1), Stage(1, 2, 3))):
        with pytest.raises(ValueError):
            evaluate(instance, Solution(bad))


@pytest.mark.parametrize("n_layers,n_stages", [(80, 10), (80, 6), (7, 3), (5, 5), (81, 8)])
def test_vllm_uniform_split(n_layers: int, n_stages: int) -> None:
    counts = vllm_uniform_counts(n_layers, n_stages)
    assert sum(counts) == n_layers and max(counts) - min(counts) <= 1
    assert counts[-1] == n_layers // n_stages  # the LM-head stage never gets the extra layer
    extra = n_layers % n_stages
    assert counts[-1 - extra : -1] == [n_layers // n_stages + 1] * extra


def test_proportional_counts_sum_and_order() -> None:
    rng = np.random.default_rng(5)
    for _ in range(50):
        weights = rng.uniform(0.1, 5.0, size=int(rng.integers(1, 12)))
        n = int(rng.integers(1, 200))
        counts = proportional_counts(n, weights)
        assert sum(counts) == n
        share = n * weights / weights.sum()
        assert np.all(np.abs(np.array(counts) - share) < 1.0)


def test_baselines_are_evaluated_and_infeasible_ones_say_why() -> None:
    rng = np.random.default_rng(2)
    roomy = random_instance(rng, 12, 4, n_types=2)
    results = run_baselines(roomy)
    assert set(results) == {"uniform", "memory_proportional", "compute_proportional", "petals_greedy"}
    for result in results.values():
        if result.solution is not None:
            assert result.evaluation.objective == evaluate(roomy, result.solution).objective
            assert result.feasible == result.evaluation.feasible
            assert result.feasible or result.reason
    assert len(results["uniform"].solution.stages) == 4
    tight = random_instance(np.random.default_rng(4), 12, 4, n_types=2, tight_memory=True)
    for device in tight.devices:
        object.__setattr__(device, "memory_bytes", 0.5 * GIB)
    for result in run_baselines(tight).values():
        assert not result.feasible and result.reason


def test_petals_greedy_fills_fastest_devices_first() -> None:
    rng = np.random.default_rng(9)
    instance = random_instance(rng, 20, 4)
    result = run_baselines(instance)["petals_greedy"]
    speed = 1.0 / instance.prefill.unit_time_s.sum(axis=0)
    used = [s.device for s in result.solution.stages]
    assert used == sorted(used, key=lambda j: -speed[j])
    for se in result.evaluation.stages:
        assert se.held_bytes <= instance.devices[se.stage.device].memory_bytes
