"""The simulator slows a stage by its emulated schedule and runs the server's remap decision."""

from __future__ import annotations

import pytest

from tessel.errors import TesselError
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


# ---- issue 42, item 1: a decision every nanosecond of simulated time ---------------------------------
def _decisions_at_every_tick(plan_path, report, settings: RemapSettings) -> list:
    """The oracle: the server's watcher replayed at every tick of the run, idle or not (the replay
    before issue 42, which took a decision per tick however long the run)."""
    import bisect
    import itertools

    from tessel.plan.files.cluster import load_cluster
    from tessel.plan.files.plan_file import load_plan
    from tessel.plan.remap.remap_decision import RemapDecider, RemapWindow, StageCounters
    from tessel.sim.remap import _stage_boxes

    plan = load_plan(plan_path)
    result = report.runs[0].result
    decider = RemapDecider(plan, load_cluster(plan.cluster.source), settings)
    window = RemapWindow(settings.window_s)
    ends, busy = _stage_boxes(result)
    arrivals = sorted((r.request.arrival_s, r.request.prompt_tokens) for r in result.records)
    finishes = sorted((r.finish_s, r.request.output_tokens) for r in result.records)
    end_s = max(r.finish_s for r in result.records)
    decisions, a, f = [], 0, 0
    for tick in itertools.count(1):
        now = tick * settings.interval_s
        if now > end_s:
            break
        counts = [bisect.bisect_right(stage_ends, now) for stage_ends in ends]
        window.observe_stages(now, [StageCounters(n, b[n]) for n, b in zip(counts, busy, strict=True)])
        while a < len(arrivals) and arrivals[a][0] <= now:
            window.observe_arrival(*arrivals[a])
            a += 1
        while f < len(finishes) and finishes[f][0] <= now:
            window.observe_finish(*finishes[f])
            f += 1
        decisions.append(decider.evaluate(now, window.stats(now)))
        if decisions[-1].taken:
            break
    return decisions


def _sparse_workload(tmp_path, rate: float):
    (tmp_path / "sparse.yaml").write_text(
        WORKLOAD.replace("arrival_rate_per_s: 4", f"arrival_rate_per_s: {rate}")
    )
    return str(tmp_path / "sparse.yaml")


@pytest.mark.parametrize(
    ("speed", "rate", "interval_s", "window_s"),
    [(0.3, 4.0, 0.5, 3.0), (0.3, 0.05, 0.5, 3.0), (0.8, 0.2, 1.0, 1.0), (0.3, 1.0, 0.1, 0.1)],
)
def test_the_replay_takes_the_decisions_of_every_tick(tmp_path, speed, rate, interval_s, window_s):
    """Skipping the ticks far from any micro-batch changes no decision: the same outcomes, reasons and
    times as a replay of every tick, and as many evaluations counted."""
    plan = _plan(tmp_path, speed)
    settings = RemapSettings(interval_s=interval_s, window_s=window_s, confirm=2)
    report = simulate_plan(
        plan, _sparse_workload(tmp_path, rate), SimulationSettings(requests=40, remap=settings)
    )
    every = _decisions_at_every_tick(plan, report, settings)
    replayed = report.remap
    assert replayed.evaluations == len(every)
    assert [(d.time_s, d.outcome, d.reason) for d in replayed.decisions if d.outcome != "insufficient"] == [
        (d.time_s, d.outcome, d.reason) for d in every if d.outcome != "insufficient"
    ]
    skipped = {d.time_s for d in every} - {d.time_s for d in replayed.decisions}
    assert all(d.outcome == "insufficient" for d in every if d.time_s in skipped)


@pytest.mark.timeout(300)  # a hang, not a speed: before issue 42 this replay took ten million decisions
def test_remap_decisions_are_bounded_by_the_work_not_the_simulated_time(tmp_path):
    plan = _plan(tmp_path, 0.3)
    settings = RemapSettings(interval_s=0.1, window_s=0.1)  # the floor, over a run of months
    report = simulate_plan(
        plan, _sparse_workload(tmp_path, 1e-6), SimulationSettings(requests=3, remap=settings)
    )
    from tessel.sim.remap import TICK_MARGIN

    remap, result = report.remap, report.runs[0].result
    end_s = max(r.finish_s for r in result.records)
    assert end_s > 1e5 and remap.evaluations == pytest.approx(end_s / settings.interval_s, abs=1)
    boxes = sum(1 for box in result.intervals if box.kind == "compute")
    per_box = 2 * settings.window_s / settings.interval_s + 2 * TICK_MARGIN + 1
    assert len(remap.decisions) <= boxes * per_box < remap.evaluations / 100


@pytest.mark.timeout(300)  # a hang: before issue 42 this ran for ever
def test_a_decision_per_nanosecond_is_refused_naming_the_floor(tmp_path):
    """Issue 42, item 1, verbatim: --remap-interval-s 1e-9 was accepted (only > 0 was checked)."""
    from typer.testing import CliRunner

    from tessel.cli import app

    plan = _plan(tmp_path, 0.3)
    args = ["simulate", "--plan", str(plan), "--requests", "2", "--remap", "auto"]
    result = CliRunner().invoke(app, [*args, "--remap-interval-s", "1e-9", "--remap-window-s", "1e-9"])
    message = " ".join(result.output.replace("\u2502", " ").split())
    assert result.exit_code == 2 and "--remap-interval-s" in message and "below 0.1 (" in message
    with pytest.raises(TesselError, match=r"--remap-interval-s must be .* \[0\.1, "):
        RemapSettings(interval_s=1e-9, window_s=1e-9)


@pytest.mark.timeout(300)  # a hang: before issue 42 this replay took a decision every 0.1 s of a day
def test_more_decisions_than_a_replay_takes_are_refused(tmp_path):
    """A day-long window at the floor interval puts every micro-batch in 1.7 million decisions."""
    plan = _plan(tmp_path, 0.3)
    settings = RemapSettings(interval_s=0.1, window_s=86400.0)
    with pytest.raises(TesselError, match="more than the 100,000 a simulation replays"):
        simulate_plan(plan, _sparse_workload(tmp_path, 1e-4), SimulationSettings(requests=2, remap=settings))
