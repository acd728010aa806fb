"""`tessel simulate`: each stage's predicted MFU, against FLOPs counted by hand over the batches the
simulation gave it (Llama-3-8B on A100-80Gs, fp16 peak 312 TFLOP/s)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tessel.cli import app
from tessel.cost import DEFAULT_MEMORY_EFFICIENCY
from tessel.plan.api import PlanSettings, make_plan
from tessel.sim.api import SimulationSettings, simulate_plan
from tessel.sim.utilization import stage_utilization

H, A, G, D, F, V = 4096, 32, 8, 128, 14336, 128256
MATMUL = H * A * D + 2 * H * G * D + A * D * H + 3 * H * F


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    settings = PlanSettings(solver="dp", time_limit_s=5)
    make_plan("llama-3-8b", "a100-8x80g", "default", settings).plan_file().write(path)
    return path


def _hand_flops(intervals, layers: int, last: bool) -> float:
    flops = 0.0
    for interval in intervals:
        for item in interval.items:
            if item.kind == "prefill":
                pairs = item.tokens * (item.offset + item.tokens / 2)
            else:
                pairs = item.offset + 1
            flops += layers * (2 * item.tokens * MATMUL + 4 * A * D * pairs)
            if last and item.samples:
                flops += 2 * H * V
    return flops


def test_stage_mfu_is_hand_counted_flops_over_busy_time(plan_path):
    report = simulate_plan(plan_path, "default", SimulationSettings(requests=20))
    run = report.runs[0]
    stages = run.variant.stages
    got = stage_utilization(report.plan_file, stages, run.result, run.metrics.stage_busy_s)
    for index, (stage, u) in enumerate(zip(stages, got, strict=True)):
        intervals = [i for i in run.result.intervals if i.kind == "compute" and i.stage == index]
        flops = _hand_flops(intervals, stage.layer_end - stage.layer_start, index == len(stages) - 1)
        # a tensor-parallel stage (the default plan has them): one rank does 1/degree of the FLOPs
        assert u.mfu == pytest.approx(flops / (stage.tp_degree * run.metrics.stage_busy_s[index] * 312e12))
        assert 0 < u.mbu < DEFAULT_MEMORY_EFFICIENCY


def test_simulate_table_has_the_columns(plan_path):
    result = CliRunner().invoke(app, ["simulate", "--plan", str(plan_path), "--requests", "10"])
    assert result.exit_code == 0, result.output
    assert "MFU %" in result.output and "MBU %" in result.output
