"""`tessel plan` end to end: tables, the plan JSON contract, the vLLM export, and user errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tessel.cli import app

STAGE_KEYS = {
    "index",
    "device",
    "gpu_type",
    "node",
    "layer_start",
    "layer_end",
    "unit_start",
    "unit_end",
    "weights_gib",
    "kv_gib",
    "offload_gib",
    "kv_preemption",  # optional: swap or recompute of evicted KV, with the host link it was priced on
    "kv_evicted_gib",
    "host_h2d_gbps",
    "host_d2h_gbps",
    "prefill_ms",
    "decode_ms",
    "link_to_next",
    "emulate_speed",
    "emulate_schedule",  # optional: the cluster's speed changes over time
    "emulate_memory_gib",  # optional: an emulated device memory cap
    "emulate_host_gbps",  # optional: an emulated host link
    "host_gib",  # the node's host memory for offloading
    "offload_layers",  # the layers streamed from host memory (whole layers)
    "precisions",  # version 2: null without a precision choice
    "tp_degree",  # version 5: tensor parallelism, the GPU of each rank and the ring's link
    "gpus",
    "tp_link",
}
TOP_KEYS = {
    "version",
    "flow",  # version 4: null unless a flow plan
    "model",
    "cluster",
    "workload",
    "dtype",
    "kv_dtype",
    "granularity",
    "overlap",
    "swap_in",
    "stages",
    "predicted",
    "objective",
    "solver",
    "baselines",
    "precisions",  # version 2: [] / null / [] without a precision choice or replicas
    "quality",
    "replicas",
}


def _check_stages(stages: list[dict], n_layers: int, units_per_layer: int) -> None:
    assert stages and all(set(stage) == STAGE_KEYS for stage in stages)
    assert stages[0]["unit_start"] == 0 and stages[-1]["unit_end"] == n_layers * units_per_layer
    for a, b in zip(stages, stages[1:], strict=False):
        assert a["unit_end"] == b["unit_start"]
        assert a["link_to_next"]["bandwidth_gbps"] > 0
    assert stages[-1]["link_to_next"] is None
    assert [s["index"] for s in stages] == list(range(len(stages)))


@pytest.mark.parametrize("granularity", ["layer", "sublayer"])
def test_plan_writes_the_contract(tmp_path, granularity: str) -> None:
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        app,
        ["plan", "--time-limit", "4", "--granularity", granularity, "--json", str(out), "--export", "vllm"],
    )
    assert result.exit_code == 0, result.output
    assert "VLLM_PP_LAYER_PARTITION=" in result.output and "vllm serve" in result.output
    assert "KV capacity" in result.output
    data = json.loads(out.read_text())
    assert set(data) == TOP_KEYS and data["version"] == 5
    assert data["precisions"] == [] and data["quality"] is None and data["replicas"] == []
    assert data["model"]["config"]["num_layers"] == 80 and data["granularity"] == granularity
    assert data["cluster"] == {"name": "mixed-a100-v100-t4", "source": "mixed-a100-v100-t4"}
    assert {"m", "alpha_f", "alpha_r"} <= set(data["workload"])
    _check_stages(data["stages"], 80, 2 if granularity == "sublayer" else 1)
    assert set(data["predicted"]) == {"ttft_s", "tpot_s", "throughput_tok_s", "steady_state_tok_s"}
    assert set(data["solver"]) == {"name", "status", "gap", "time_s"}
    assert set(data["baselines"]) == {
        "uniform",
        "memory_proportional",
        "compute_proportional",
        "petals_greedy",
    }
    for baseline in data["baselines"].values():
        assert set(baseline) == {"feasible", "reason", "objective", "predicted", "stages"}
        if baseline["feasible"]:
            assert baseline["objective"] >= data["objective"] * (1 - 1e-9)  # tessel's plan is never worse
            _check_stages(baseline["stages"], 80, 2 if granularity == "sublayer" else 1)
        else:
            assert baseline["reason"]
    # the vLLM partition covers every layer
    partition = next(line for line in result.output.splitlines() if "VLLM_PP_LAYER_PARTITION=" in line)
    counts = [int(c) for c in partition.split("=", 1)[1].split()[0].split(",")]
    assert sum(counts) == 80 and len(counts) == len(data["stages"])


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tessel.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_model_too_big_for_gpus_and_host_exits_2(tmp_path) -> None:
    cluster = tmp_path / "one-t4.yaml"
    cluster.write_text("name: one-t4\nnodes:\n  - name: n0\n    gpus: {type: T4, count: 1}\n")
    result = _run_cli("plan", "--cluster", str(cluster), "--time-limit", "5")
    assert result.returncode == 2
    assert "needs" in result.stderr and "GiB more" in result.stderr
    assert "Traceback" not in result.stderr


def test_offloading_the_first_stage_is_charged_or_refused(tmp_path) -> None:
    """Host memory covers the shortfall on a single GPU: charged by default, refused under --swap-in hidden
    (the only stage is the first one, and nothing upstream hides its swap-in)."""
    cluster = tmp_path / "one-t4-host.yaml"
    cluster.write_text(
        "name: one-t4-host\nnodes:\n  - name: n0\n    gpus: {type: T4, count: 1}\n    host_memory_gib: 1024\n"
    )
    args = ["plan", "--model", "llama-2-7b", "--cluster", str(cluster), "--time-limit", "5"]
    plan_path = tmp_path / "plan.json"
    result = CliRunner().invoke(app, [*args, "--json", str(plan_path)])
    assert result.exit_code == 0, result.output
    data = json.loads(plan_path.read_text())
    assert data["swap_in"] == "charged"
    assert data["stages"][0]["offload_gib"] > 0
    result = CliRunner().invoke(app, [*args, "--swap-in", "hidden"])
    assert result.exit_code != 0
    message = str(result.exception)
    assert type(result.exception).__name__ == "TesselError"
    assert "no plan fits" in message and "GiB more" in message and "--swap-in charged" in message


def test_bad_options_are_user_errors() -> None:
    """Choices typer checks itself (usage error, exit 2, naming the option); a name no file or bundle has
    is a TesselError (exit 2 from `main`)."""
    runner = CliRunner()
    for args in (
        ["--solver", "gurobi"],
        ["--export", "trt"],
        ["--granularity", "token"],
        ["--swap-in", "never"],
    ):
        result = runner.invoke(app, ["plan", "--time-limit", "2", *args])
        assert result.exit_code == 2, (args, result.output)
        assert f"Invalid value for '{args[0]}'" in " ".join(result.output.split()), result.output
    result = runner.invoke(app, ["plan", "--time-limit", "2", "--cluster", "nope"])
    assert type(result.exception).__name__ == "TesselError", result.exception
