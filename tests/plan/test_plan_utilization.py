"""`tessel plan`'s predicted decode MFU and MBU per stage, against FLOPs counted by hand."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tessel.cli import app
from tessel.cost import DEFAULT_MEMORY_EFFICIENCY
from tessel.plan.api import PlanSettings, make_plan
from tessel.plan.report import decode_utilization

# Llama-3-8B: h 4096, a 32, g 8, d 128, f 14336, vocab 128256
H, A, G, D, F, V = 4096, 32, 8, 128, 14336, 128256
MATMUL = H * A * D + 2 * H * G * D + A * D * H + 3 * H * F


@pytest.fixture(scope="module")
def outcome():
    return make_plan("llama-3-8b", "a100-8x80g", "default", PlanSettings(solver="dp", time_limit_s=5))


def test_stage_mfu_is_hand_counted_flops_over_stage_time(outcome):
    b = outcome.workload.micro_batch_size
    context = outcome.workload.mean_decode_context_tokens
    evaluation = outcome.result.evaluation
    got = decode_utilization(
        outcome.instance, evaluation, model=outcome.model, cluster=outcome.cluster,
        batch_size=b, decode_context=context,
    )  # fmt: skip
    assert len(got) == len(evaluation.stages)
    for index, (se, u) in enumerate(zip(evaluation.stages, got, strict=True)):
        layers = se.stage.unit_end - se.stage.unit_start
        flops = layers * (2 * b * MATMUL + 4 * A * D * b * context)
        if index == len(got) - 1:
            flops += 2 * b * H * V
        degree = outcome.instance.devices[se.stage.device].tp_degree  # a TP stage: one rank's 1/degree
        assert u.mfu == pytest.approx(flops / (degree * se.time_decode_s * 312e12))
        assert 0 < u.mbu < DEFAULT_MEMORY_EFFICIENCY  # the roofline's memory efficiency bounds it


def test_plan_table_has_the_columns():
    result = CliRunner().invoke(
        app, ["plan", "--model", "llama-3-8b", "--cluster", "a100-8x80g", "--solver", "dp"]
    )
    assert result.exit_code == 0, result.output
    assert "decode MFU %" in result.output and "decode MBU %" in result.output
