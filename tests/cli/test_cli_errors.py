"""Issue 14, CLI part: unreadable inputs, directories as outputs, out-of-range options and oversized
problems end as user errors (exit code 2, a message, no traceback) before any long work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import BINARY, LATIN1, time_guard, user_error

from tessel.errors import TesselError

CLUSTER_YAML = "name: one\nnodes:\n  - name: n0\n    gpus: {type: A100-80G, count: 2}\n"


def _unreadable(tmp_path: Path, kind: str, suffix: str) -> Path:
    if kind == "directory":
        path = tmp_path / f"folder{suffix}"
        path.mkdir()
        return path
    path = tmp_path / f"{kind}{suffix}"
    path.write_bytes(BINARY if kind == "binary" else LATIN1)
    return path


KINDS = ["binary", "latin1", "directory"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "option,suffix",
    [("--cluster", ".yaml"), ("--workload", ".yaml"), ("--model", ".json"), ("--profile", ".json")],
)
def test_plan_inputs_that_are_not_text(tmp_path: Path, kind: str, option: str, suffix: str) -> None:
    path = _unreadable(tmp_path, kind, suffix)
    message = user_error(["plan", "--time-limit", "2", option, path])
    assert str(path.name) in message or "directory" in message
    if kind == "latin1":
        assert "UTF-8" in message or "directory" in message


@pytest.mark.parametrize("kind", KINDS)
def test_replan_from_and_plan_files_that_are_not_text(tmp_path: Path, kind: str) -> None:
    path = _unreadable(tmp_path, kind, ".json")
    assert path.name in user_error(["plan", "--time-limit", "2", "--replan-from", path])
    assert path.name in user_error(["chunk", "--plan", path, "--seq-len", "4096"])
    assert path.name in user_error(["simulate", "--plan", path, "--requests", "2"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_traces_that_are_not_text(tmp_path: Path, plan_file: Path, kind: str, suffix: str) -> None:
    path = _unreadable(tmp_path, kind, suffix)
    assert path.name in user_error(["simulate", "--plan", plan_file, "--workload", path])


@pytest.mark.parametrize("kind", KINDS)
def test_model_directory_or_config_that_is_not_text(tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    config = folder / "config.json"
    if kind == "directory":
        config.mkdir()
    else:
        config.write_bytes(BINARY if kind == "binary" else LATIN1)
    assert "config.json" in user_error(["chunk", "--model", folder, "--seq-len", "4096"])


def test_python_api_readers_raise_tessel_error(tmp_path: Path) -> None:
    from tessel.catalog.models import load_model
    from tessel.cost.profile import load_profile
    from tessel.plan.files.cluster import load_cluster
    from tessel.plan.files.workload import load_workload
    from tessel.sim.requests import load_trace

    binary = tmp_path / "b.yaml"
    binary.write_bytes(BINARY)
    control = tmp_path / "c.yaml"
    control.write_text("name: \x07bell\nnodes: []\n")  # UTF-8, but YAML refuses control characters
    for loader in (load_cluster, load_workload):
        for path in (binary, control, tmp_path):
            with pytest.raises(TesselError):
                loader(path)
    for loader, suffix in ((load_model, ".json"), (load_profile, ".json"), (load_trace, ".csv")):
        path = tmp_path / f"x{suffix}"
        path.write_bytes(LATIN1)
        with pytest.raises(TesselError, match="UTF-8"):
            loader(path)


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--time-limit", "2", "--json", "{dir}"],
        ["chunk", "--model", "llama-3-8b", "--stages", "2", "--seq-len", "4096", "--json", "{dir}"],
        ["simulate", "--plan", "{plan}", "--requests", "2", "--json", "{dir}"],
        ["simulate", "--plan", "{plan}", "--requests", "2", "--gantt", "{dir}"],
        ["profile", "--tiny-shape", "64,128,4,2", "--budget-s", "30", "--out", "{dir}"],
    ],
)
def test_directory_as_output_is_refused_before_any_work(
    tmp_path: Path, plan_file: Path, args: list[str]
) -> None:
    folder = tmp_path / "out.json"
    folder.mkdir()
    args = [a.format(dir=folder, plan=plan_file) for a in args]
    message = user_error(args, guard_s=20)  # profile would time layers for 30 s first
    assert "directory" in message
    assert "profiling" not in message and "TTFT" not in message


def test_output_in_a_folder_that_is_a_file_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    message = user_error(["chunk", "--model", "llama-3-8b", "--seq-len", "256", "--json", blocker / "c.json"])
    assert "not a folder" in message


@pytest.mark.parametrize(
    "extra",
    [
        ["--grid", "0"],
        ["--grid", "-64"],
        ["--max-chunk-tokens", "-5"],
        ["--max-chunk-tokens", "0"],
        ["--seq-len", "10000000"],
        ["--seq-len", "99999999999999999999"],
        ["--seq-len", "1000000"],
        ["--seq-len", "0"],
        ["--seq-len", ",".join(["4096"] * 2000)],
    ],
)
def test_chunk_sizes_out_of_range(extra: list[str]) -> None:
    args = ["chunk", "--model", "llama-3-8b", "--stages", "2"]
    if extra[0] != "--seq-len":
        args += ["--seq-len", "4096"]
    message = user_error([*args, *extra], guard_s=30)
    assert any(word in message for word in ("--grid", "--max-chunk-tokens", "--seq-len", "grid steps")), (
        message
    )


def test_chunk_planner_api_refuses_huge_problems() -> None:
    from tessel.chunk.api import chunk_prompts
    from tessel.chunk.planner import MAX_GRID_STEPS

    with pytest.raises(TesselError, match="grid of at least 245"):
        chunk_prompts([1_000_000], model="llama-3-8b", stages=2)
    with pytest.raises(TesselError, match="grid must be"):
        chunk_prompts([4096], model="llama-3-8b", stages=2, grid_tokens=0)
    with pytest.raises(TesselError, match="max chunk tokens"):
        chunk_prompts([4096], model="llama-3-8b", stages=2, max_chunk_tokens=0)
    # the limit itself is accepted (checked without planning: the problem is only validated)
    from tessel.chunk.planner import check_problem_size

    check_problem_size([64 * MAX_GRID_STEPS], 64, None)
    with pytest.raises(TesselError):
        check_problem_size([64 * MAX_GRID_STEPS + 1], 64, None)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "1e300"])
def test_time_limit_must_be_finite_and_positive(value: str) -> None:
    assert "--time-limit" in user_error(["plan", "--time-limit", value], guard_s=20)


def test_time_limit_zero_is_refused_by_the_api() -> None:
    from tessel.plan.api import PlanSettings

    for value in (0.0, float("nan"), float("inf"), -3.0):
        with pytest.raises(TesselError, match="time limit"):
            PlanSettings(time_limit_s=value)


@pytest.mark.parametrize("count", [257, 3000, 100000, 10**30])
def test_cluster_size_is_bounded(tmp_path: Path, count: int) -> None:
    cluster = tmp_path / "big.yaml"
    cluster.write_text(CLUSTER_YAML.replace("count: 2", f"count: {count}"))
    message = user_error(["plan", "--cluster", cluster, "--time-limit", "5"], guard_s=20)
    assert "256" in message


def test_many_nodes_add_up_to_the_cluster_bound(tmp_path: Path) -> None:
    nodes = "".join(f"  - name: n{i}\n    gpus: {{type: T4, count: 100}}\n" for i in range(3))
    cluster = tmp_path / "nodes.yaml"
    cluster.write_text(f"name: many\nnodes:\n{nodes}network: {{bandwidth_gbps: 25}}\n")
    assert "300 GPUs" in user_error(["plan", "--cluster", cluster, "--time-limit", "5"], guard_s=20)


def test_simulate_requests_are_bounded(plan_file: Path) -> None:
    from tessel.sim.request_trace import MAX_REQUESTS

    message = user_error(["simulate", "--plan", plan_file, "--requests", "100000000"], guard_s=20)
    assert "--requests" in message and str(MAX_REQUESTS) in message.replace(",", "")


def test_workload_batch_beyond_the_simulation_bound(tmp_path: Path, plan_file: Path) -> None:
    workload = tmp_path / "w.yaml"
    workload.write_text("name: big\nprompt_tokens: 100\noutput_tokens: 10\nbatch_size: 900000\n")
    message = user_error(["simulate", "--plan", plan_file, "--workload", workload], guard_s=20)
    assert "at most" in message and "--requests" in message


def test_main_prints_the_message_without_a_traceback(tmp_path: Path) -> None:
    binary = tmp_path / "cluster.yaml"
    binary.write_bytes(BINARY)
    result = subprocess.run(
        [sys.executable, "-m", "tessel.cli", "plan", "--cluster", str(binary)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "binary" in result.stderr and "Traceback" not in result.stderr


def test_guard_itself_fires() -> None:
    import time

    with pytest.raises(Exception, match="more than"), time_guard(0.05):
        time.sleep(1)


@pytest.mark.parametrize(
    "fields",
    [
        {"num_attention_heads": 0},
        {"num_attention_heads": 1e400},
        {"hidden_size": float("nan")},
        {"rope_theta": "fast"},
        {"architectures": 7},
    ],
)
def test_model_config_values_that_crashed_the_reader(tmp_path: Path, fields: dict) -> None:
    import json

    from tessel.catalog.models import load_model

    config = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
    config |= {"intermediate_size": 128, "vocab_size": 100, "rope_theta": 10000.0} | fields
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(TesselError):
        load_model(path)


@pytest.mark.parametrize(
    "extra", [["--max-chunk", "16", "--max-offset", "0"], ["--max-chunk", "48", "--max-offset", "0"]]
)
def test_profile_grids_too_small_to_fit_are_refused_before_timing(tmp_path: Path, extra: list[str]) -> None:
    """It ended in a ValueError traceback from the fit after the layers were timed."""
    args = ["profile", "--tiny-shape", "64,128,4,2", "--budget-s", "30", "--out", tmp_path / "p.json", *extra]
    message = user_error(args, guard_s=20)
    assert "--max-chunk" in message and "at least 8" in message
    assert not (tmp_path / "p.json").exists()
