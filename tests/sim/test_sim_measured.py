"""Measured metrics of a launch run (against hand-computed values), the run file `simulate --measured`
reads and its refusals, the overload message and the Gantt chart's default window."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim.sim_plans import write_plan
from tessel.cli import app
from tessel.errors import TesselError
from tessel.sim.api import SimulationSettings, simulate_plan
from tessel.sim.gantt import WINDOW_MICRO_BATCHES, default_window_s
from tessel.sim.load import check_load
from tessel.sim.measured import compare_metrics, load_run, measured_metrics, relative_error

RECORDS = [
    {"num_prompt_tokens": 3, "num_output_tokens": 5, "ttft_s": 0.1, "tpot_s": 0.02},
    {"num_prompt_tokens": 4, "num_output_tokens": 3, "ttft_s": 0.3, "tpot_s": 0.04},
    {"num_prompt_tokens": 2, "num_output_tokens": 1, "ttft_s": 0.2, "tpot_s": None},  # no TPOT
]


def test_measured_metrics_by_hand() -> None:
    m = measured_metrics(RECORDS, wall_s=0.5)
    assert (m.requests, m.prompt_tokens, m.output_tokens) == (3, 9, 9)
    assert m.ttft_s.mean == pytest.approx(0.2) and m.ttft_s.p50 == pytest.approx(0.2)
    assert m.ttft_s.p99 == pytest.approx(0.2 + 0.98 * 0.1)  # linear between the 2nd and 3rd of 3
    assert m.tpot_s.mean == pytest.approx(0.03) and m.tpot_s.p50 == pytest.approx(0.03)
    assert m.tpot_s.p99 == pytest.approx(0.02 + 0.99 * 0.02)
    assert m.throughput_tok_s == pytest.approx(9 / 0.5)


def test_measured_metrics_refuse_empty_and_bad_wall() -> None:
    with pytest.raises(TesselError, match="no requests"):
        measured_metrics([], 1.0)
    with pytest.raises(TesselError, match="wall_s"):
        measured_metrics(RECORDS, 0.0)


def test_relative_error_and_comparison_rows(tmp_path: Path) -> None:
    assert relative_error(1.2, 1.0) == pytest.approx(0.2)
    assert math.isnan(relative_error(1.0, 0.0)) and math.isnan(relative_error(float("nan"), 1.0))
    report = simulate_plan(write_plan(tmp_path), "default", SimulationSettings(requests=5))
    rows = compare_metrics(report.runs[0].metrics, measured_metrics(RECORDS, 0.5))
    assert [r.key for r in rows][-1] == "throughput_tok_s" and len(rows) == 7
    throughput = rows[-1]
    assert throughput.measured == pytest.approx(18.0)
    assert throughput.error == pytest.approx((throughput.predicted - 18.0) / 18.0)


def run_document(**run_overrides) -> dict:
    run = {
        "plan": "plan.json",
        "model_name": "tiny-llama",
        "cluster_name": "test",
        "stage_layers": [[0, 4], [4, 6], [6, 8]],
        "replica": None,
        "micro_batches": 3,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
        **run_overrides,
    }
    return {"version": 1, "run": run, "requests": RECORDS, "wall_s": 0.5}


def write_run(tmp_path: Path, document: dict | str) -> Path:
    path = tmp_path / "run.json"
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


def test_load_run_reads_the_requests_as_a_batch(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path, run_document()))
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in run.requests] == [
        (0.0, 3, 5),
        (0.0, 4, 3),
        (0.0, 2, 1),
    ]
    assert run.identity.micro_batches == 3 and run.metrics.throughput_tok_s == pytest.approx(18.0)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("{not json", "not valid JSON|JSON"),
        (json.dumps({"requests": []}), "no `run` section"),
        (json.dumps({**run_document(), "version": 7}), "version 7"),
        (json.dumps(run_document(stage_layers="0-4")), "stage_layers"),
        (json.dumps(run_document(micro_batches=0)), "micro_batches"),
        (json.dumps({**run_document(), "requests": []}), "non-empty list"),
        (json.dumps({**run_document(), "requests": [{"num_prompt_tokens": 3}]}), "num_output_tokens"),
        (json.dumps({**run_document(), "wall_s": "fast"}), "wall_s"),
        (
            json.dumps({**run_document(), "requests": [{**RECORDS[0], "ttft_s": -1.0}]}),
            r"requests\[0\].ttft_s",
        ),
    ],
)
def test_load_run_refuses_malformed_files(tmp_path: Path, document: str, message: str) -> None:
    with pytest.raises(TesselError, match=message):
        load_run(write_run(tmp_path, document))


def test_simulate_measured_refuses_a_run_of_another_plan(tmp_path: Path) -> None:
    plan = write_plan(tmp_path)
    run = write_run(tmp_path, run_document(model_name="other-model", stage_layers=[[0, 8]]))
    result = CliRunner().invoke(app, ["simulate", "--plan", str(plan), "--measured", str(run)])
    assert isinstance(result.exception, TesselError), result.output
    message = str(result.exception)
    assert "model: run 'other-model', plan 'tiny-llama'" in message
    assert "stage layers: run '0-7', plan '0-3, 4-5, 6-7'" in message
    result = CliRunner().invoke(
        app, ["simulate", "--plan", str(plan), "--measured", str(run), "--requests", "5"]
    )
    assert isinstance(result.exception, TesselError) and "drop --requests" in str(result.exception)


def test_simulate_measured_on_a_matching_run(tmp_path: Path) -> None:
    plan, out = write_plan(tmp_path), tmp_path / "sim.json"
    run = write_run(tmp_path, run_document())
    args = ["simulate", "--plan", str(plan), "--measured", str(run), "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Predicted vs measured" in result.output and "TPOT p99 (ms)" in result.output
    document = json.loads(out.read_text())
    assert document["requests"] == 3
    rows = {row["key"]: row for row in document["measured"]["comparison"]}
    assert rows["throughput_tok_s"]["measured"] == pytest.approx(18.0)
    assert math.isfinite(rows["ttft_s.mean"]["error"])


def _workload(tmp_path: Path, rate: float) -> Path:
    path = tmp_path / f"w{rate:g}.yaml"
    path.write_text(
        "name: steady\nprompt_tokens: {mean: 200}\noutput_tokens: {mean: 40}\n"
        f"arrival_rate_per_s: {rate}\n"
    )
    return path


def test_overload_is_named_with_offered_load_and_capacity(tmp_path: Path) -> None:
    plan = write_plan(tmp_path)
    heavy, light = (["--workload", str(_workload(tmp_path, r)), "--requests", "200"] for r in (1e5, 0.5))
    out = tmp_path / "heavy.json"
    result = CliRunner().invoke(app, ["simulate", "--plan", str(plan), *heavy, "--json", str(out)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "overloaded: offered load" in text and "more than the plan serves" in text
    load = json.loads(out.read_text())["load"]
    assert load["overloaded"] and load["offered_tok_s"] > load["served_tok_s"]
    result = CliRunner().invoke(app, ["simulate", "--plan", str(plan), *light])
    assert result.exit_code == 0 and "overloaded" not in result.output


def test_check_load_skips_a_closed_batch(tmp_path: Path) -> None:
    report = simulate_plan(write_plan(tmp_path), "default", SimulationSettings(requests=20, rate_per_s=None))
    run = report.runs[0]
    if all(r.request.arrival_s == 0 for r in run.result.records):
        assert check_load(run.result, run.metrics) is None


def test_gantt_default_window_at_200_requests(tmp_path: Path) -> None:
    plan = write_plan(tmp_path)
    workload = _workload(tmp_path, 50.0)
    report = simulate_plan(plan, str(workload), SimulationSettings(requests=200))
    result = report.runs[0].result
    cut = default_window_s(result)
    assert cut is not None and cut < report.runs[0].metrics.makespan_s
    first_stage = sorted(i.end_s for i in result.intervals if i.kind == "compute" and i.stage == 0)
    assert cut == first_stage[WINDOW_MICRO_BATCHES - 1]
    chart = tmp_path / "g.svg"
    args = ["simulate", "--plan", str(plan), "--workload", str(workload), "--requests", "200"]
    result = CliRunner().invoke(app, [*args, "--gantt", str(chart)])
    assert result.exit_code == 0, result.output
    assert "--gantt-until-s draws more" in " ".join(result.output.split()) and chart.is_file()
