"""`tessel plan` with tensor-parallel stages: the table shows each stage's GPUs and degree, --max-tp 1 is
the pipeline-only plan, and --export vllm writes --tensor-parallel-size (or says what is lost)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from plan.tp_cases import cluster, problem, small_model, workload
from tessel.cli import app
from tessel.plan.files.export_vllm import export_vllm
from tessel.plan.tp.search import solve_tp

ARGS = ["plan", "--cluster", "a100x8-t4x4", "--workload", "single-stream", "--time-limit", "5"]


def test_plan_prints_gpus_and_degree_and_exports_vllm(tmp_path) -> None:
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, [*ARGS, "--json", str(out), "--export", "vllm"])
    assert result.exit_code == 0, result.output
    assert "dgx/gpu0-7" in result.output and "┃ TP ┃" in result.output
    assert "tensor parallelism: stage degrees 8" in result.output
    assert "pipeline-only (--max-tp 1): TPOT" in result.output
    assert "--tensor-parallel-size 8" in result.output and "--pipeline-parallel-size 1" in result.output
    assert "VLLM_PP_LAYER_PARTITION=80" in result.output
    stages = json.loads(out.read_text())["stages"]
    assert [(s["tp_degree"], len(s["gpus"])) for s in stages] == [(8, 8)]


def test_max_tp_one_is_todays_pipeline(tmp_path) -> None:
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, [*ARGS, "--max-tp", "1", "--json", str(out), "--export", "vllm"])
    assert result.exit_code == 0, result.output
    assert "┃ TP ┃" not in result.output and "tensor parallelism" not in result.output
    assert "--tensor-parallel-size 1" in result.output
    assert all(
        s["tp_degree"] == 1 and s["gpus"] == [s["device"]] for s in json.loads(out.read_text())["stages"]
    )


def test_max_tp_out_of_range_is_refused() -> None:
    result = CliRunner().invoke(app, [*ARGS, "--max-tp", "16"])
    assert result.exit_code == 2 and "--max-tp" in result.output


def test_export_of_unequal_degrees_says_what_is_lost() -> None:
    the_cluster = cluster(("v", "V100-32G", 3, "nvlink"))
    base, ctx = problem(small_model(5), the_cluster, workload(8, 4, prompt=512, output=32))
    found = solve_tp(base, ctx, 8, solver="dp", time_limit_s=10, mip_gap=0.0)
    assert sorted(found.degrees) == [1, 2]  # asymmetric: a pair and one GPU alone
    exported = export_vllm(found.instance, found.result.evaluation, model=ctx.model)
    assert "--tensor-parallel-size 1" in exported.command
    lost = next(w for w in exported.warnings if "tensor-parallel degrees" in w)
    assert "vLLM runs one degree on every stage" in lost and "2 -> 1 GPUs" in lost


def test_no_machine_with_two_gpus_plans_as_before() -> None:
    """CPU devices (and single-GPU machines) have no degree above 1: no search, no TP line."""
    from tessel.plan.api import PlanSettings, make_plan

    outcome = make_plan("llama-3-8b", "local-cpu", "default", PlanSettings(solver="dp", time_limit_s=3))
    assert outcome.tp is None and outcome.base_instance is None
