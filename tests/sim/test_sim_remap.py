"""The simulator slows a stage by its emulated schedule and runs the server's remap decision."""

from __future__ import annotations

import pytest

from tessel.plan.api import PlanSettings, make_plan
from tessel.plan.remap.remap_decision import RemapSettings
from tessel.sim.api import SimulationSettings, simulate_plan

CLUSTER = """\
name: two-a100-slowing
nodes:
  - name: a
    gpus: {{type: A100-80G}}
  - name: b
    gpus: {{type: A100-80G}}
    emulate: {{speed: 1.0, schedule: [[10, {speed}]]}}
network: {{bandwidth_gbps: 100, latency_us: 10}}
"""
WORKLOAD = """\
name: short-chat
prompt_tokens: {mean: 128, max: 512}
output_tokens: {mean: 48, max: 128}
arrival_rate_per_s: 4
"""
SETTINGS = RemapSettings(interval_s=2.0, window_s=6.0, confirm=2)


def _plan(tmp_path, speed: float):
    (tmp_path / "cluster.yaml").write_text(CLUSTER.format(speed=speed))
    (tmp_path / "workload.yaml").write_text(WORKLOAD)
    files = (tmp_path / "cluster.yaml", tmp_path / "workload.yaml")
    outcome = make_plan("llama-2-7b", *files, PlanSettings(solver="dp"))
    outcome.plan_file().write(tmp_path / "plan.json")
    return tmp_path / "plan.json"


def _run(plan, remap: RemapSettings | None = SETTINGS):
    settings = SimulationSettings(requests=120, remap=remap)
    return simulate_plan(plan, str(plan.parent / "workload.yaml"), settings)


def test_the_schedule_slows_its_stage_from_its_seconds(tmp_path):
    report = _run(_plan(tmp_path, 0.25), remap=None)
    boxes = [i for i in report.runs[0].result.intervals if i.kind == "compute"]
    first = {k: min(i.start_s for i in boxes if i.stage == k) for k in (0, 1)}

    def per_token(stage, early):
        chosen = [i for i in boxes if i.stage == stage and (i.start_s - first[stage] < 10) == early]
        decode = [i for i in chosen if all(item.kind == "decode" for item in i.items) and len(i.items) == 1]
        return min(i.end_s - i.start_s for i in decode)

    assert per_token(1, early=False) == pytest.approx(4 * per_token(1, early=True), rel=0.05)
    assert per_token(0, early=False) == pytest.approx(per_token(0, early=True), rel=0.05)


@pytest.mark.parametrize(("speed", "remaps"), [(0.3, True), (0.8, False)])
def test_a_slowdown_remaps_only_when_it_pays(tmp_path, speed, remaps):
    report = _run(_plan(tmp_path, speed))
    remap = report.remap
    assert (remap.taken is not None) == remaps
    document = report.to_json()["remap"]
    assert document["remap"] == remaps
    if remaps:
        taken = remap.taken
        assert taken.time_s > 10.0  # the schedule's change, seen in measured step times only
        assert taken.speeds[1] < 1 / SETTINGS.min_slowdown
        assert document["new_layers"] != [list(r) for r in taken.old_layers]
    else:
        # never a stage seen as drifted (the arrival rate falls as the trace ends: kept, no gain)
        assert {d.outcome for d in remap.decisions} <= {"insufficient", "steady", "kept"}
        assert all("stage" not in d.reason for d in remap.decisions if d.outcome == "kept")


def test_remap_flags_without_remap_auto_are_refused(tmp_path):
    from typer.testing import CliRunner

    from tessel.cli import app

    plan = _plan(tmp_path, 0.3)
    result = CliRunner().invoke(app, ["simulate", "--plan", str(plan), "--remap-threshold", "0.5"])
    message = f"{result.output} {result.exception}"
    assert result.exit_code != 0 and "--remap-threshold" in message and "--remap auto" in message
    short_window = ["--remap", "auto", "--remap-window-s", "1"]  # below the 2 s interval
    result = CliRunner().invoke(app, ["simulate", "--plan", str(plan), *short_window])
    assert result.exit_code != 0 and "--remap-window-s" in f"{result.output} {result.exception}"
