"""The remap decision: its window, its speed estimate, its hysteresis and its settings."""

from __future__ import annotations

import math

import pytest

from tessel.errors import TesselError
from tessel.plan.api import PlanSettings, make_plan
from tessel.plan.files.cluster import load_cluster
from tessel.plan.files.plan_file import load_plan
from tessel.plan.remap.remap_decision import (
    RemapDecider,
    RemapSettings,
    RemapWindow,
    StageCounters,
    WindowStats,
    estimated_speeds,
    predicted_step_s,
)

CLUSTER = """\
name: two-a100
nodes:
  - name: a
    gpus: {type: A100-80G}
  - name: b
    gpus: {type: A100-80G}
network: {bandwidth_gbps: 100, latency_us: 10}
"""


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    work = tmp_path_factory.mktemp("remap")
    (work / "cluster.yaml").write_text(CLUSTER)
    outcome = make_plan("llama-2-7b", work / "cluster.yaml", "default", PlanSettings(solver="dp"))
    outcome.plan_file().write(work / "plan.json")
    plan = load_plan(work / "plan.json")
    return plan, load_cluster(plan.cluster.source)


def _stats(step_s, batches=20, requests=0):
    return WindowStats(10.0, (batches,) * len(step_s), tuple(step_s), requests, None, None, None)


@pytest.mark.parametrize(
    ("name", "value", "flag"),
    [
        ("threshold", math.nan, "--remap-threshold"),
        ("threshold", 1.0, "--remap-threshold"),
        ("threshold", -0.1, "--remap-threshold"),
        ("horizon_s", 0.0, "--remap-horizon-s"),
        ("horizon_s", math.inf, "--remap-horizon-s"),
        ("interval_s", math.nan, "--remap-interval-s"),
        ("min_slowdown", 1.0, "--remap-min-slowdown"),
        ("cooldown_s", -1.0, "--remap-cooldown-s"),
        ("confirm", 0, "--remap-confirm"),
    ],
)
def test_out_of_range_or_nan_settings_are_refused_naming_the_flag(name, value, flag):
    with pytest.raises(TesselError, match=flag):
        RemapSettings(**{name: value})


def test_the_window_is_shorter_than_an_evaluation_interval_refused():
    with pytest.raises(TesselError, match="--remap-window-s"):
        RemapSettings(interval_s=5.0, window_s=2.0)


def test_window_gives_step_times_over_its_last_seconds():
    window = RemapWindow(window_s=10.0)
    for t in range(0, 31):  # stage 0: 1 batch of 10 ms per s; stage 1: 10 ms until 20 s, then 30 ms
        busy1 = 0.01 * min(t, 20) + 0.03 * max(t - 20, 0)
        window.observe_stages(float(t), [StageCounters(t, 0.01 * t), StageCounters(t, busy1)])
        window.observe_arrival(float(t), 100 + t)
    stats = window.stats(30.0)
    assert stats.batches == (10, 10)
    assert stats.step_s == pytest.approx((0.01, 0.03))
    assert stats.requests == 11  # arrivals at 20..30 s
    assert stats.mean_prompt_tokens == pytest.approx(125.0)
    window.observe_stages(31.0, [StageCounters(0, 0.0), StageCounters(0, 0.0)])  # restarted stages
    assert window.stats(31.0) is None


def test_estimated_speeds_are_relative_to_the_fastest_stage():
    # stage 1 takes 3x its prediction, stage 0 exactly its own: stage 1 runs at a third
    assert estimated_speeds([0.01, 0.03], [0.01, 0.01], [1.0, 1.0]) == pytest.approx((1.0, 1 / 3))
    # what the cost model gets wrong for both cancels
    assert estimated_speeds([0.02, 0.02], [0.01, 0.01], [1.0, 1.0]) == pytest.approx((1.0, 1.0))
    # a stage priced at 0.5 that measures as predicted runs at 0.5; one that recovered at 1
    assert estimated_speeds([0.01, 0.02], [0.01, 0.02], [1.0, 0.5]) == pytest.approx((1.0, 0.5))
    assert estimated_speeds([0.01, 0.01], [0.01, 0.02], [1.0, 0.5]) == pytest.approx((1.0, 1.0))


def test_a_mild_slowdown_is_steady_and_a_large_one_remaps_after_confirmation(planned):
    plan, cluster = planned
    predicted = predicted_step_s(plan)
    decider = RemapDecider(plan, cluster, RemapSettings(confirm=2, cooldown_s=30.0))
    mild = decider.evaluate(10.0, _stats([predicted[0], predicted[1] / 0.8]))
    assert mild.outcome == "steady" and mild.new_plan is None
    assert decider.evaluate(11.0, _stats(predicted, batches=3)).outcome == "insufficient"
    slow = _stats([predicted[0], predicted[1] / 0.3])
    first = decider.evaluate(12.0, slow)
    assert first.outcome == "unconfirmed" and first.gain > 0.1
    second = decider.evaluate(14.0, slow)
    assert second.outcome == "remap" and second.new_plan is not None
    assert second.speeds[1] == pytest.approx(0.3)
    assert second.new_layers != second.old_layers
    moved = sum(abs(a[1] - b[1]) for a, b in zip(second.old_layers, second.new_layers, strict=True))
    assert moved > 0 and second.move_bytes > 0
    for line in ("remap", "gain", "layers"):
        assert line in second.describe()
    # the new plan keeps what the runtime emulates: no stage sleeps because of the re-pricing
    assert [s.emulate_speed for s in second.new_plan.stages] == [1.0, 1.0]

    decider.adopt(second, 14.0)
    assert decider.assumed[plan.stages[1].device] == pytest.approx(0.3)
    # the new split measured as its (re-priced) plan predicts: nothing drifted
    settled = _stats(list(predicted_step_s(decider.plan)))
    assert decider.evaluate(20.0, settled).outcome == "steady"
    # the device recovers to full speed at once: drift, but within the cooldown
    slowed = plan.stages[1].device
    stages = decider.plan.stages
    steps = [p * (0.3 if s.device == slowed else 1) for p, s in zip(settled.step_s, stages, strict=True)]
    recovered = decider.evaluate(22.0, _stats(steps))
    assert recovered.outcome == "cooldown"


def test_a_gain_below_the_threshold_keeps_the_plan(planned):
    plan, cluster = planned
    predicted = predicted_step_s(plan)
    decider = RemapDecider(plan, cluster, RemapSettings(threshold=0.9, confirm=1))
    kept = decider.evaluate(10.0, _stats([predicted[0], predicted[1] / 0.3]))
    assert kept.outcome == "kept" and kept.gain < 0.9 and "below" in kept.reason


GROWN = CLUSTER.replace(
    "network:", "  - name: c\n    gpus: {type: A100-80G}\n  - name: d\n    gpus: {type: T4}\nnetwork:"
)


def test_a_machine_that_joins_is_priced_and_the_plan_grows_onto_it_when_it_gains(tmp_path):
    """llama-2-7b served on two A100s (a, b); a third A100 (c) and a T4 (d) join: the re-plan on the
    grown cluster uses the new A100 (the model says three stages beat two by more than the threshold,
    the move counted) and the decision is a remap at once, no confirmation; with a threshold no gain
    reaches, the plan is kept and the decision says why."""
    plan, grown = _served_on_two_and_grown(tmp_path)
    decider = RemapDecider(plan, grown, RemapSettings(threshold=0.05, confirm=3))
    decision = decider.evaluate_joined(100.0, ["c", "d"])
    assert decision.outcome == "remap", decision.reason
    assert decision.reason.startswith("c, d joined the cluster")
    assert decision.old_devices == ("a/gpu0", "b/gpu0")
    assert "c/gpu0" in decision.new_devices and decision.new_plan is not None
    assert decision.gain > 0.05 and decision.new_objective < decision.old_objective
    assert [s.device for s in decision.new_plan.stages] == list(decision.new_devices)
    decider.adopt(decision, 100.0)
    assert decider.plan is decision.new_plan
    kept = RemapDecider(plan, grown, RemapSettings(threshold=0.99)).evaluate_joined(100.0, ["c", "d"])
    assert kept.outcome == "kept" and kept.new_plan is None and "joined the cluster" in kept.reason


def test_a_grown_plan_keeps_its_first_stage_where_the_server_runs(tmp_path):
    """Over Ray the server runs stage 0: the plan re-made on the grown cluster starts on `first_node`."""
    plan, grown = _served_on_two_and_grown(tmp_path)
    for node in ("a", "b"):
        decider = RemapDecider(plan, grown, RemapSettings(threshold=0.05), first_node=node)
        decision = decider.evaluate_joined(100.0, ["c", "d"])
        assert decision.outcome == "remap", decision.reason
        assert decision.new_devices[0].startswith(f"{node}/")


def _served_on_two_and_grown(tmp_path):
    """llama-2-7b planned on CLUSTER (two A100s), and the GROWN cluster (two more machines joined)."""
    (tmp_path / "two.yaml").write_text(CLUSTER)
    (tmp_path / "grown.yaml").write_text(GROWN)
    outcome = make_plan("llama-2-7b", tmp_path / "two.yaml", "default", PlanSettings(solver="dp"))
    outcome.plan_file().write(tmp_path / "plan.json")
    return load_plan(tmp_path / "plan.json"), load_cluster(tmp_path / "grown.yaml")
