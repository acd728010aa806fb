"""An emulated speed schedule: from the cluster file through the plan file to the runtime's stage."""

from __future__ import annotations

import json
import os
import time

import pytest

from tessel.errors import TesselError
from tessel.plan.files.cluster import parse_cluster
from tessel.plan.files.plan_file import parse_plan
from tessel.plan.files.plan_parts import emulated_speed_at


def _cluster(schedule) -> dict:
    return {
        "name": "two-cpus",
        "nodes": [
            {"name": "a", "gpus": {"type": "cpu", "count": 1}},
            {"name": "b", "gpus": {"type": "cpu"}, "emulate": {"speed": 1.0, "schedule": schedule}},
        ],
        "network": {"bandwidth_gbps": 80, "latency_us": 50},
    }


def test_speed_at_follows_the_last_change_at_or_before_the_time():
    schedule = [[2.0, 0.5], [5.0, 0.25]]
    got = [emulated_speed_at(0.8, schedule, t) for t in (0.0, 1.99, 2.0, 4.9, 5.0, 1e9)]
    assert got == [0.8, 0.8, 0.5, 0.5, 0.25, 0.25]
    assert emulated_speed_at(0.7, None, 100.0) == 0.7
    assert emulated_speed_at(0.7, (), 100.0) == 0.7


def test_cluster_devices_carry_the_schedule():
    cluster = parse_cluster(_cluster([[30, 0.3]]))
    assert cluster.device("b/gpu0").emulate_schedule == ((30.0, 0.3),)
    assert cluster.device("a/gpu0").emulate_schedule == ()
    assert cluster.device("b/gpu0").emulate_speed == 1.0  # the planner prices the speed, not the schedule


@pytest.mark.parametrize(
    ("schedule", "words"),
    [
        ([[5, 0.5], [3, 0.4]], "above the previous"),
        ([[-1, 0.5]], ">= 0"),
        ([[1, 0.001]], "speed 0.001"),
        ([[1, 1.5]], "speed 1.5"),
        ([[1, float("nan")]], "speed nan"),
        ([[float("inf"), 0.5]], "seconds inf"),
    ],
)
def test_bad_schedules_are_refused_with_the_reason(schedule, words):
    with pytest.raises(TesselError, match=words):
        parse_cluster(_cluster(schedule))


def _plan(stage1_extra: dict) -> dict:
    stage = {"gpu_type": "cpu", "node": "n", "link_to_next": None}
    return {
        "version": 3,
        "model": {"name": "m"},
        "stages": [
            {**stage, "index": 0, "device": "a/gpu0", "layer_start": 0, "layer_end": 2, "unit_start": 0,
             "unit_end": 2},
            {**stage, "index": 1, "device": "b/gpu0", "layer_start": 2, "layer_end": 4, "unit_start": 2,
             "unit_end": 4, **stage1_extra},
        ],
    }  # fmt: skip


def test_plan_stage_schedule_round_trips_and_older_plans_load():
    plan = parse_plan(_plan({"emulate_schedule": [[30, 0.3]]}))
    assert plan.stages[1].emulate_schedule == [[30.0, 0.3]]
    again = parse_plan(json.loads(plan.dump()))
    assert again.stages[1].emulate_schedule == [[30.0, 0.3]]
    assert parse_plan(_plan({})).stages[1].emulate_schedule is None  # a plan written before schedules
    with pytest.raises(TesselError, match="emulate_schedule"):
        parse_plan(_plan({"emulate_schedule": [[30, 0.0001]]}))


def test_run_plan_and_stage_executor_follow_the_schedule(tmp_path):
    from tessel.engine.emulation import SlowDevice
    from tessel.pipeline.run_plan import load_run_plan
    from tessel.pipeline.stage.runner import StageRunner
    from tessel.pipeline.supervision.heartbeat import StageProgress

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan({"emulate_schedule": [[0.0, 0.5]]})))
    stage = load_run_plan(path).stages[1]
    assert stage.emulate_schedule == ((0.0, 0.5),)
    executor = StageRunner(None, None, SlowDevice(stage.emulate_speed, stage.emulate_schedule))
    executor.progress = StageProgress()
    executor.account(time.perf_counter() - 0.002, tokens=3)
    stats = executor.stats
    assert stats.emulation_sleep_s == pytest.approx((1 / 0.5 - 1) * stats.compute_s)
    assert (executor.progress.batches, executor.progress.tokens) == (1, 3)
    assert executor.progress.busy_s == pytest.approx(stats.compute_s + stats.emulation_sleep_s)


def test_a_later_stage_counts_its_schedule_from_the_published_epoch(monkeypatch):
    from tessel.engine.emulation import EMULATE_EPOCH_ENV, SlowDevice
    from tessel.pipeline.stage.runner import StageRunner

    monkeypatch.delenv(EMULATE_EPOCH_ENV, raising=False)
    first = StageRunner(None, None, SlowDevice(1.0, publish_epoch=True))
    first.account(time.perf_counter(), tokens=1)
    assert EMULATE_EPOCH_ENV in os.environ
    # a stage of a pipeline built later (a remap) slows at once: its schedule's change is long past
    later = StageRunner(None, None, SlowDevice(1.0, ((0.0, 0.5),)))
    later.account(time.perf_counter() - 0.002, tokens=1)
    assert later.slow.origin_s == pytest.approx(first.slow.origin_s, abs=0.05)
    assert later.stats.emulation_sleep_s == pytest.approx(later.stats.compute_s)
