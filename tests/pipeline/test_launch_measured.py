"""`tessel launch --json` writes the measured TTFT, TPOT and throughput; `tessel simulate --measured`
simulates that run's requests and compares (the error is computed, its size not asserted)."""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner

from pipeline_plans import write_plan
from tessel.cli import app
from tessel.errors import TesselError


def test_launch_measured_then_simulate_measured(tiny_dirs, tmp_path):
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)], micro_batches=2)
    run_file = tmp_path / "run.json"
    prompts = ["Hello world", "Once upon a time", "The quick brown fox"]
    args = ["launch", "--plan", str(plan), "--model", str(model), "--max-tokens", "5", "--ignore-eos"]
    for prompt in prompts:
        args += ["--prompt", prompt]
    result = CliRunner().invoke(app, [*args, "--json", str(run_file)])
    assert result.exit_code == 0, result.output
    document = json.loads(run_file.read_text())
    measured = document["measured"]
    assert measured["requests"] == 3 and measured["output_tokens"] == 15
    assert measured["throughput_tok_s"] == 15 / document["wall_s"]
    ttfts = [r["ttft_s"] for r in document["requests"]]
    assert measured["ttft_s"]["mean"] == sum(ttfts) / 3
    assert document["run"]["stage_layers"] == [[0, 2], [2, 5]] and document["run"]["micro_batches"] == 2

    out = tmp_path / "compare.json"
    result = CliRunner().invoke(
        app, ["simulate", "--plan", str(plan), "--measured", str(run_file), "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "Predicted vs measured" in result.output
    comparison = json.loads(out.read_text())["measured"]["comparison"]
    assert {row["key"] for row in comparison} >= {"ttft_s.p50", "tpot_s.p99", "throughput_tok_s"}
    for row in comparison:
        assert row["predicted"] > 0 and row["measured"] > 0 and math.isfinite(row["error"])

    other = write_plan(tmp_path / "other.json", model, [(0, 3), (3, 5)], micro_batches=2)
    result = CliRunner().invoke(app, ["simulate", "--plan", str(other), "--measured", str(run_file)])
    assert isinstance(result.exception, TesselError)
    assert "stage layers: run '0-1, 2-4', plan '0-2, 3-4'" in str(result.exception)
