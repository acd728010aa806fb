"""`tessel simulate` end to end on a hand-written plan file (and on `tessel plan`'s, when present)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim.sim_plans import write_plan
from tessel.cli import app
from tessel.errors import TesselError


def test_simulate_prints_metrics_and_writes_json_and_gantt(tmp_path: Path) -> None:
    plan = write_plan(tmp_path)
    out, chart = tmp_path / "sim.json", tmp_path / "chart.svg"
    workload = tmp_path / "w.yaml"
    workload.write_text(
        "name: short\nprompt_tokens: {mean: 300, max: 2000}\noutput_tokens: {mean: 12, max: 40}\n"
        "arrival_rate_per_s: 20\n"
    )
    args = ["simulate", "--plan", str(plan), "--workload", str(workload), "--requests", "30", "--seed", "3"]
    result = CliRunner().invoke(app, [*args, "--compare", "--json", str(out), "--gantt", str(chart)])
    assert result.exit_code == 0, result.output
    assert "TTFT p99" in result.output and "uniform" in result.output and "short: 30 Poisson" in result.output
    assert "petals_greedy: not simulated (does not fit)" in result.output
    document = json.loads(out.read_text())
    assert set(document["results"]) == {"plan", "uniform"}
    metrics = document["results"]["plan"]["metrics"]
    assert metrics["requests"] == 30 and metrics["throughput_tok_s"] > 0
    assert len(metrics["stage_utilisation"]) == 3
    assert chart.read_text().lstrip().startswith("<?xml")
    # the same seed gives the same numbers
    again = tmp_path / "again.json"
    assert CliRunner().invoke(app, [*args, "--json", str(again)]).exit_code == 0
    assert json.loads(again.read_text())["results"]["plan"] == document["results"]["plan"]


def test_simulate_reads_a_trace_and_cpp(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,3000,4\n0.01,200,8\n0.5,50,1\n")
    out = tmp_path / "sim.json"
    plan = write_plan(tmp_path)
    args = [
        "simulate",
        "--plan",
        str(plan),
        "--workload",
        str(trace),
        "--cpp",
        "--kv-limit",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["config"]["kv_limit"] is True and document["config"]["pipelined_prefill"] is True
    metrics = document["results"]["plan"]["metrics"]
    assert metrics["requests"] == 3 and metrics["output_tokens"] == 13 and metrics["prompt_tokens"] == 3250


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.pop("stages"), "'stages' must be a non-empty list"),
        (lambda p: p["stages"][1].pop("gpu_type"), "stages[1] lacks 'gpu_type'"),
        (lambda p: p["stages"][1].update(unit_start=5), "not contiguous"),
        (lambda p: p["stages"][2].update(unit_end=7, layer_end=7), "cover 7 units, the model has 8"),
        (lambda p: p["stages"][0].update(link_to_next=None), "has no link_to_next"),
    ],
)
def test_bad_plan_files_are_user_errors(tmp_path: Path, mutate, message: str) -> None:  # noqa: ANN001
    path = write_plan(tmp_path)
    plan = json.loads(path.read_text())
    mutate(plan)
    path.write_text(json.dumps(plan))
    result = CliRunner().invoke(app, ["simulate", "--plan", str(path), "--requests", "2"])
    assert isinstance(result.exception, TesselError), result.output
    assert message in str(result.exception)


def test_bad_trace_is_a_user_error(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 2}\n{"arrival_s": 1}\n')
    plan = write_plan(tmp_path)
    result = CliRunner().invoke(app, ["simulate", "--plan", str(plan), "--workload", str(trace)])
    assert isinstance(result.exception, TesselError)
    assert "t.jsonl:2: field 'prompt_tokens' is missing" in str(result.exception)


def test_simulate_a_plan_from_tessel_plan(tmp_path: Path) -> None:
    from tessel.cli import app as cli_app

    names = {command.name for command in cli_app.registered_commands}
    if "plan" not in names:
        pytest.skip("`tessel plan` is not registered yet")
    plan = tmp_path / "plan.json"
    args = ["--model", "llama-2-7b", "--cluster", "llmpq-t4-v100", "--solver", "dp", "--time-limit", "2"]
    made = CliRunner().invoke(cli_app, ["plan", *args, "--json", str(plan)])
    assert made.exit_code == 0, made.output
    result = CliRunner().invoke(
        cli_app,
        [
            "simulate",
            "--plan",
            str(plan),
            "--requests",
            "20",
            "--compare",
            "--json",
            str(tmp_path / "s.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "s.json").read_text())["results"]
    assert results["plan"]["metrics"]["requests"] == 20


def test_kv_limit_needs_kv_in_the_plan(tmp_path: Path) -> None:
    path = write_plan(tmp_path)
    plan = json.loads(path.read_text())
    for stage in plan["stages"]:
        stage.pop("kv_gib")
    path.write_text(json.dumps(plan))
    result = CliRunner().invoke(app, ["simulate", "--plan", str(path), "--requests", "2", "--kv-limit"])
    assert isinstance(result.exception, TesselError)
    assert "gives no kv_gib" in str(result.exception)


def test_unknown_gantt_format_fails_before_simulating(tmp_path: Path) -> None:
    plan = write_plan(tmp_path)
    result = CliRunner().invoke(app, ["simulate", "--plan", str(plan), "--gantt", str(tmp_path / "g.bmp")])
    assert isinstance(result.exception, TesselError) and "unknown format '.bmp'" in str(result.exception)
    assert "TTFT" not in result.output


@pytest.mark.slow
def test_simulator_ranks_the_plan_as_the_planner_does(tmp_path: Path) -> None:
    """In the regime the planner priced (m pinned micro-batches of b, KV limited), the default plan
    simulates faster than every feasible baseline, and each baseline's simulated throughput is within
    25% of the planner's prediction for it. Pipeline-only (--max-tp 1): at 120 requests ramp-up and
    drain put both the pipeline-only plan (0.751x) and the tensor-parallel default (0.742x) at the
    edge of 25%; tests/sim/test_sim_tp.py holds TP stage times to the planner's."""
    plan = tmp_path / "plan.json"
    args = ["plan", "--solver", "dp", "--time-limit", "5", "--max-tp", "1", "--json", str(plan)]
    made = CliRunner().invoke(app, args)
    assert made.exit_code == 0, made.output
    out = tmp_path / "sim.json"
    args = ["simulate", "--plan", str(plan), "--requests", "120", "--seed", "1", "--compare"]
    args += ["--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["config"]["regime"] == "plan" and document["config"]["pinned"]
    results = document["results"]
    simulated = {name: r["metrics"]["throughput_tok_s"] for name, r in results.items()}
    assert len(simulated) >= 3
    assert all(simulated["plan"] > simulated[name] for name in simulated if name != "plan"), simulated
    for name, r in results.items():
        predicted = r["predicted"]["throughput_tok_s"]
        assert abs(simulated[name] - predicted) <= 0.25 * predicted, (name, simulated[name], predicted)


def test_regime_defaults_come_from_the_plan_workload(tmp_path: Path) -> None:
    from tessel.plan.files.plan_file import load_plan
    from tessel.sim.regime import regime_defaults

    path = write_plan(tmp_path)
    data = json.loads(path.read_text())
    data["workload"] = {"m": 4, "micro_batch_size": 3}
    path.write_text(json.dumps(data))
    plan = load_plan(path)
    assert regime_defaults(plan, "plan") == regime_defaults(plan, "plan").__class__(12, 4, True, True)
    continuous = regime_defaults(plan, "continuous")
    assert (continuous.max_num_seqs, continuous.max_in_flight, continuous.pinned) == (256, None, False)
    data["workload"] = {"name": "no m"}
    path.write_text(json.dumps(data))
    assert regime_defaults(load_plan(path), "plan") == continuous
    result = CliRunner().invoke(app, ["simulate", "--plan", str(path), "--regime", "vllm"])
    assert result.exit_code == 2 and "Invalid value for '--regime'" in result.output  # typer's own check


def test_scheduler_flags_take_the_engines_names_and_keep_the_old_ones_hidden(tmp_path: Path) -> None:
    """--max-num-seqs / --max-num-batched-tokens (vLLM's names); --max-running / --max-batch-tokens
    still work, unlisted in --help, and give the same simulation."""
    plan = write_plan(tmp_path)
    base = ["simulate", "--plan", str(plan), "--requests", "20", "--seed", "2", "--regime", "continuous"]
    documents = []
    for flags in (["--max-num-seqs", "3", "--max-num-batched-tokens", "256"],
                  ["--max-running", "3", "--max-batch-tokens", "256"]):  # fmt: skip
        out = tmp_path / f"{len(documents)}.json"
        result = CliRunner().invoke(app, [*base, *flags, "--json", str(out)])
        assert result.exit_code == 0, result.output
        documents.append(json.loads(out.read_text()))
    config = documents[0]["config"]
    assert (config["max_num_seqs"], config["max_num_batched_tokens"]) == (3, 256)
    assert documents[0]["config"] == documents[1]["config"]
    assert documents[0]["results"] == documents[1]["results"]
    help_text = CliRunner().invoke(app, ["simulate", "--help"], env={"COLUMNS": "200"}).output
    assert "--max-num-seqs" in help_text and "--max-num-batched-tokens" in help_text
    assert "--max-running" not in help_text and "--max-batch-tokens" not in help_text
    bad = CliRunner().invoke(app, [*base, "--max-running", "0"])
    assert bad.exit_code == 2 and "--max-running" in bad.output  # typer's own range check
