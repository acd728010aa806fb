"""`tessel launch`: each stage's measured MFU and MBU, checked against the stage's own counters and
FLOPs counted by hand from the checkpoint's config (the catalog's generic CPU peak: 2.56 TFLOP/s fp32)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipeline_plans import write_plan
from tessel.cli import app

CPU_FP32_FLOPS, CPU_BYTES_PER_S = 2.56e12, 204.8e9


def test_launch_reports_stage_mfu_and_mbu(tiny_dirs, tmp_path):
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)], micro_batches=2)
    run_file = tmp_path / "run.json"
    args = ["launch", "--plan", str(plan), "--model", str(model), "--max-tokens", "4", "--ignore-eos"]
    result = CliRunner().invoke(app, [*args, "--prompt", "Hello world", "--json", str(run_file)])
    assert result.exit_code == 0, result.output
    config = json.loads((model / "config.json").read_text())
    h, f, a = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    g = config.get("num_key_value_heads", a)
    d = config.get("head_dim", h // a)
    matmul = h * a * d + 2 * h * g * d + a * d * h + 3 * h * f
    for stage in json.loads(run_file.read_text())["stages"]:
        layers = stage["layer_end"] - stage["layer_start"]
        flops = layers * 2 * stage["tokens"] * matmul
        assert stage["tokens"] > 0 and stage["compute_s"] > 0
        util = stage["utilization"]
        assert util["mfu"] == pytest.approx(flops / (stage["compute_s"] * CPU_FP32_FLOPS))
        weights = layers * stage["batches"] * (4 * matmul + 4 * 2 * h)  # fp32 matmuls + two RMSNorms
        assert util["mbu"] > weights / (stage["compute_s"] * CPU_BYTES_PER_S)
    assert "MFU %" in result.output or "MFU" in result.stderr
