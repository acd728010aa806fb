"""The steady-state throughput prediction (`tessel.plan.report.steady_state_tok_s`, issue 48) beside
the objective's figure.

Oracles: counts by hand of the round max(sum_j T_j, k max_j T_j); the plan file's own stage times
worked by hand; and `tessel simulate` serving a 4-stage pipeline with k < S (the round is one pass,
sum-bound) and k >= S (bottleneck-bound), where the objective's figure (fill paid every round) is
more than 20% off and the steady-state figure within 5%. Files written before the figure still read."""

from __future__ import annotations

import json
import types

import pytest
from rich.console import Console

from tessel.plan.files.plan_file import load_plan, parse_plan
from tessel.plan.files.plan_parts import Predicted, Replica, whole_predicted
from tessel.plan.report import routed_tok_s, steady_state_line, steady_state_tok_s

CLUSTER = {
    "name": "four-l4",
    "nodes": [{"name": "n", "gpus": {"type": "L4", "count": 4}, "intra_link": "pcie", "host_memory_gib": 64}],
}


def test_steady_state_against_hand_counts() -> None:
    # stages 3, 1, 1, 1 s per prefill pass, 0.3, 0.1, 0.1, 0.1 s per decode step; b = 2, n_out = 10
    pre, dec = [3.0, 1.0, 1.0, 1.0], [0.3, 0.1, 0.1, 0.1]
    # k = 1: a round is one pass (6 s, 0.6 s): 1 * 2 * 10 / (6 + 10 * 0.6) = 20 / 12
    assert steady_state_tok_s(pre, dec, 1, 2, 10.0) == pytest.approx(20 / 12)
    # k = 2 < S = 4: 2 x 3 = 6 = sum, still one pass a round: twice k = 1
    assert steady_state_tok_s(pre, dec, 2, 2, 10.0) == pytest.approx(40 / 12)
    # k = 4 >= S: the bottleneck serves 4 passes a round, 12 s and 1.2 s: 4 * 2 * 10 / (12 + 12)
    assert steady_state_tok_s(pre, dec, 4, 2, 10.0) == pytest.approx(80 / 24)
    # the objective's form at k = 4 charges the fill: 6 + 3 x 3 = 15 s, 0.6 + 3 x 0.3 = 1.5 s
    assert 80 / (15 + 15) < steady_state_tok_s(pre, dec, 4, 2, 10.0)
    # equal stages, k < S: sum-bound, k / S of the bottleneck's rate
    assert steady_state_tok_s([1.0] * 4, [0.1] * 4, 3, 1, 10.0) == pytest.approx(30 / (4 + 10 * 0.4))
    # time shares (a flow path): the bottleneck is 0.1 / 0.25 = 0.4 s per step on the shared device
    shared = steady_state_tok_s([1.0, 1.0], [0.1, 0.1], 3, 1, 10.0, shares=[0.25, 1.0])
    assert shared == pytest.approx(30 / (max(2.0, 3 * 4.0) + 10 * max(0.2, 3 * 0.4)))
    assert steady_state_tok_s(pre, dec, 0, 2, 10.0) == 0.0
    assert routed_tok_s([300.0, 100.0], [0.25, 0.75]) == pytest.approx(400.0 / 3)


def test_the_line_names_what_bounds_the_round() -> None:
    stage = types.SimpleNamespace
    evaluation = stage(stages=[stage(time_decode_s=t) for t in (0.3, 0.1, 0.1, 0.1)])
    line = steady_state_line(80 / 24, 2.0, [(4, evaluation)])
    assert line.startswith("steady state: 3.3 tok/s (k=4, S=4, k >= S: no fill per round), 1.667x")
    assert "a round is one pass through every stage" in steady_state_line(1.0, 1.0, [(1, evaluation)])
    assert steady_state_line(None, 1.0, [(1, evaluation)]) is None


def _plan_file(tmp_path, k: int):
    """A pipeline of 4 L4s holding 11, 7, 7, 7 layers of LLaMA-2-7B with k micro-batches, written as
    `plan_solve.py` writes a replica plan for the simulator (a flow plan of one path)."""
    from tessel.commands.plan_flow import write_and_export
    from tessel.plan.api import PlanSettings, prepare_plan
    from tessel.plan.files.cluster import parse_cluster
    from tessel.plan.files.workload import load_workload
    from tessel.plan.flow.flow import from_pipelines
    from tessel.plan.solution import Solution

    workload = load_workload("offline-batch")
    settings = PlanSettings()
    problem = prepare_plan("llama-2-7b", parse_cluster(CLUSTER), workload, settings)
    pipeline = Solution.from_counts([0, 1, 2, 3], [11, 7, 7, 7])
    plan = from_pipelines(problem.instance, [pipeline], workload.micro_batch_size, max_micro_batches=k)
    assert plan is not None and plan.micro_batches == k
    path = tmp_path / f"k{k}.json"
    write_and_export(Console(quiet=True), problem, types.SimpleNamespace(flow=plan), settings, path, None)
    return (
        path,
        plan,
        workload.micro_batch_size,
        problem.instance.decode_weight / problem.instance.prefill_weight,
    )


@pytest.mark.parametrize(("k", "sum_bound"), [(2, True), (4, False)])
def test_steady_state_against_the_simulator(tmp_path, k: int, sum_bound: bool) -> None:
    from tessel.sim.api import SimulationSettings, simulate_plan

    path, plan, b, n_out = _plan_file(tmp_path, k)
    written = load_plan(path)
    (replica,) = written.replicas
    pre = [s.prefill_ms / 1e3 for s in replica.stages]
    dec = [s.decode_ms / 1e3 for s in replica.stages]
    assert (k * max(dec) < sum(dec)) is sum_bound  # k < S: the round is one pass; k = S: the bottleneck's
    rounds = [max(sum(t), k * max(t)) for t in (pre, dec)]
    by_hand = k * b * n_out / (rounds[0] + n_out * rounds[1])
    assert plan.paths[0].steady_state_tok_s == pytest.approx(by_hand, rel=1e-6)
    assert replica.predicted.steady_state_tok_s == pytest.approx(by_hand, rel=1e-6)
    assert written.predicted.steady_state_tok_s == pytest.approx(by_hand, rel=1e-6)
    filled = [sum(t) + (k - 1) * max(t) for t in (pre, dec)]
    objective = k * b * n_out / (filled[0] + n_out * filled[1])
    assert written.predicted.throughput_tok_s == pytest.approx(objective, rel=1e-6)  # unchanged

    report = simulate_plan(path, "offline-batch", SimulationSettings(requests=2 * k * b))  # two full waves
    simulated = report.runs[0].metrics.throughput_tok_s
    assert simulated == pytest.approx(by_hand, rel=0.05), (simulated, by_hand, objective)
    assert simulated > 1.2 * objective  # the fill the objective charges is not paid


def test_old_plan_files_read_without_the_figure(tmp_path) -> None:
    path, _, _, _ = _plan_file(tmp_path, 1)
    document = json.loads(path.read_text())
    assert set(document["predicted"]) == {"ttft_s", "tpot_s", "throughput_tok_s", "steady_state_tok_s"}
    for part in (document, *document["replicas"], *document["baselines"].values()):
        if part.get("predicted"):
            part["predicted"].pop("steady_state_tok_s")
    old = parse_plan(document)
    assert old.predicted.steady_state_tok_s is None and old.predicted.throughput_tok_s > 0
    assert "steady_state_tok_s" not in old.main.predicted


STAGE = {
    "index": 0,
    "device": "n/gpu0",
    "gpu_type": "L4",
    "node": "n",
    "layer_start": 0,
    "layer_end": 8,
    "unit_start": 0,
    "unit_end": 8,
}


def test_whole_steady_state_is_where_the_first_replica_saturates() -> None:
    """The replicas' steady-state figures Y_r under the planner's weights w_r: min_r Y_r / w_r."""

    def replica(index: int, weight: float, x: float, y: float | None) -> Replica:
        predicted = Predicted(throughput_tok_s=x, steady_state_tok_s=y)
        return Replica.model_validate(
            {"index": index, "weight": weight, "stages": [STAGE], "predicted": predicted}
        )

    fast, slow = replica(0, 0.75, 300.0, 330.0), replica(1, 0.25, 100.0, 150.0)
    whole = whole_predicted([fast, slow])
    assert whole.throughput_tok_s == pytest.approx(400.0)  # unchanged
    assert whole.steady_state_tok_s == pytest.approx(min(330.0 / 0.75, 150.0 / 0.25))
    assert whole_predicted([fast, replica(1, 0.25, 100.0, None)]).steady_state_tok_s is None  # an older file
