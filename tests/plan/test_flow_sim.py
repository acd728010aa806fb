"""A flow plan's prediction against `tessel simulate` of the same plan (issue 33).

Oracles: the time-shared pipeline formula worked by hand from the plan file's own stage times (a
shared first placement, two last ones), and the simulator serving the plan file with the requests
routed over its paths and the shared GPU on one timeline; `routed_counts` against the simulator's
router; a finite batch's end and the queueing at a shared device against counts by hand."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
from rich.console import Console

from tessel.plan.api import PlanSettings, prepare_plan
from tessel.plan.files.cluster import parse_cluster
from tessel.plan.files.plan_file import load_plan
from tessel.plan.files.workload import load_workload
from tessel.plan.flow.flow import (
    FlowPath,
    FlowPlan,
    _PathCost,
    _tok_s,
    batch_throughput_tok_s,
    evaluate_flow,
    queueing_rates,
    routed_counts,
)
from tessel.plan.solution import Stage
from tessel.sim.api import SimulationSettings, simulate_plan
from tessel.sim.requests import Request
from tessel.sim.routing import route

CLUSTER = {
    "name": "one-feeds-two",
    "nodes": [
        {"name": "a", "gpus": {"type": "A100-80G", "count": 1}, "intra_link": "pcie", "host_memory_gib": 64},
        {"name": "b", "gpus": {"type": "L4", "count": 2}, "intra_link": "pcie", "host_memory_gib": 64},
    ],
    "network": {"bandwidth_gbps": 10, "latency_us": 100},
}


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [0.022, 0.5, 0.478], [1.0], [0.25] * 4])
def test_routed_counts_are_the_simulators_routing(weights) -> None:
    for n in (1, 7, 64, 301):
        requests = [Request(i, 0.0, 10, 2) for i in range(n)]
        assert routed_counts(weights, n) == [len(r) for r in route(requests, weights)]


def test_a_path_alone_keeps_the_pipeline_formula() -> None:
    """On devices of its own, the queueing rate is never below the pipeline formula, so disjoint
    paths stay priced as replicas are (`test_flow.test_disjoint_pipelines_priced_as_replicas`)."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(1, 9))
        pre = rng.uniform(1e-3, 2.0, n) * rng.uniform(0.01, 1.0)
        cost = _PathCost(tuple(range(n)), pre, rng.uniform(1e-4, 0.1, n), np.ones(n))
        n_out = float(rng.uniform(1, 600))
        for k in (1, 2, 3, 8, 40):
            alone = queueing_rates([cost], [k], n_out)[0] * 4
            assert alone >= _tok_s(cost, np.ones(n), k, 4, n_out) * (1 - 1e-9)


def test_waiting_at_a_shared_device_lowers_a_long_paths_rate() -> None:
    """Two one-micro-batch paths through the same three devices: the formula's shares (1/2 each,
    bottleneck 2 T < 3 T) see no wait; the queueing counts the other path's batch found there."""
    t = 0.01
    cost = _PathCost((0, 1, 2), np.zeros(3), np.full(3, t), np.ones(3))
    formula = _tok_s(cost, np.full(3, 0.5), 1, 1, 100.0)
    assert formula == pytest.approx(1 / (3 * t))
    queued = queueing_rates([cost, cost], [1, 1], 100.0)
    assert queued[0] == pytest.approx(queued[1])
    assert 1 / (6 * t) < queued[0] < formula  # between both served in turn and no wait at all


def test_a_finite_batch_ends_with_its_last_path() -> None:
    # two paths at 4 and 1 tok/s (weights 0.8, 0.2), micro-batches of 4 requests of 10 tokens
    paths = (FlowPath((0,), 2, 4.0, 0.8, 0.0, 0.0), FlowPath((1,), 1, 1.0, 0.2, 0.0, 0.0))
    plan = FlowPlan((), paths, 5.0)
    # 25 requests: 20 (50 s) and 5 (50 s): the steady state
    assert routed_counts([0.8, 0.2], 25) == [20, 5]
    assert batch_throughput_tok_s(plan, 25, 4, 10.0) == pytest.approx(250 / 50)
    # 10 requests: 8 (20 s) and 2, fewer than a micro-batch: a full pass per token, 4 x 10 / 1 = 40 s
    assert routed_counts([0.8, 0.2], 10) == [8, 2]
    assert batch_throughput_tok_s(plan, 10, 4, 10.0) == pytest.approx(100 / 40)
    # 27 requests: 22 (55 s) and 5 (50 s)
    assert routed_counts([0.8, 0.2], 27) == [22, 5]
    assert batch_throughput_tok_s(plan, 27, 4, 10.0) == pytest.approx(270 / 55)


def test_planned_and_simulated_throughput_of_a_shared_placement_agree(tmp_path) -> None:
    """A100 holds layers 0-19 of LLaMA-2-13B and feeds two L4s holding 20-39: two paths share the
    A100. The planner's figure (the shares' pipeline formula or the queueing at the A100, the
    smaller), worked here by hand from the plan file's stage times, and the
    simulator's tokens/s over 64 requests (4 full waves of each path's slots) agree within 5%."""
    from tessel.commands.plan_flow import write_and_export

    workload = load_workload("offline-batch")
    settings = PlanSettings()
    problem = prepare_plan("llama-2-13b", parse_cluster(CLUSTER), workload, settings)
    instance = problem.instance
    half = instance.n_units // 2
    stages = [Stage(0, 0, half), Stage(1, half, instance.n_units), Stage(2, half, instance.n_units)]
    plan = evaluate_flow(instance, stages, [((0, 1), 1.0), ((0, 2), 1.0)], workload.micro_batch_size)
    path_file = tmp_path / "flow.json"
    choice = types.SimpleNamespace(flow=plan)
    write_and_export(Console(quiet=True), problem, choice, settings, path_file, None)

    b = workload.micro_batch_size
    n_out = instance.decode_weight / instance.prefill_weight
    written = load_plan(path_file)
    by_hand = 0.0
    for replica in written.replicas:
        k = replica.micro_batches
        pre = [s.prefill_ms / 1e3 for s in replica.stages]
        dec = [s.decode_ms / 1e3 for s in replica.stages]
        shares = replica.time_shares
        assert shares[0] == pytest.approx(0.5) and shares[1] == pytest.approx(1.0)  # the A100 split evenly

        def makespan(times, k=k, shares=shares):
            bottleneck = max(t / s for t, s in zip(times, shares, strict=True))
            return max(sum(times) + (k - 1) * bottleneck, k * bottleneck)

        shared = k * b * n_out / (makespan(pre) + n_out * makespan(dec))
        # the queueing at the A100: each path's one micro-batch finds the other's there (X R_A of the
        # time), the one in service for half its time: R_A = S_A + S_A (X R_A - X S_A / 2) with
        # X = 1 / (R_A + S_B), whose root is R_A = (2 S_A - S_B + sqrt(S_B^2 + 2 S_A^2)) / 2
        assert k == 1
        s_a, s_b = (d + p / n_out for d, p in zip(dec, pre, strict=True))
        r_a = (2 * s_a - s_b + math.sqrt(s_b**2 + 2 * s_a**2)) / 2
        queued = b / (r_a + s_b)
        by_hand += min(shared, queued)
    assert plan.throughput_tok_s == pytest.approx(by_hand, rel=1e-6)
    assert written.predicted.throughput_tok_s == pytest.approx(by_hand, rel=1e-6)

    slots = plan.micro_batches * b
    n = 4 * slots
    expected = batch_throughput_tok_s(plan, n, b, n_out)
    assert expected == pytest.approx(plan.throughput_tok_s, rel=1e-9)  # whole waves: the steady state
    report = simulate_plan(path_file, "offline-batch", SimulationSettings(requests=n))
    simulated = report.runs[0].metrics.throughput_tok_s
    assert simulated == pytest.approx(expected, rel=0.05)
