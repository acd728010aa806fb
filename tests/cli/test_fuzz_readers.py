"""Fuzz every file reader of the planner side, directly and through the CLI: hostile cluster / workload
YAML, model config.json, profile JSON, plan JSON and traces give a result or a TesselError (exit code
2 from the CLI) with a message; never another exception, never a hang (each example runs under
hypothesis' deadline and a SIGALRM guard)."""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path

import hostile
from cli_helpers import succeeds_or_user_error, time_guard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessel.catalog.models import load_model
from tessel.chunk.from_plan import load_plan_pipeline
from tessel.cost.profile import load_profile
from tessel.errors import TesselError
from tessel.plan.files.cluster import load_cluster
from tessel.plan.files.plan_file import load_plan
from tessel.plan.files.workload import load_workload
from tessel.sim.requests import load_trace

READER_SETTINGS = settings(
    max_examples=150,
    deadline=timedelta(seconds=10),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
CLI_SETTINGS = settings(
    max_examples=25,
    deadline=timedelta(seconds=60),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
_FOLDER = Path(tempfile.mkdtemp(prefix="tessel-fuzz-"))


def _file(name: str, content: bytes) -> Path:
    path = _FOLDER / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def _read(reader, path: Path) -> None:  # noqa: ANN001
    with time_guard(10):
        try:
            reader(path)
        except TesselError as error:
            assert str(error).strip()


@READER_SETTINGS
@given(st.one_of(hostile.cluster_data().map(hostile.as_yaml), hostile.raw_bytes()))
def test_cluster_reader(content: bytes) -> None:
    _read(load_cluster, _file("cluster.yaml", content))


@READER_SETTINGS
@given(st.one_of(hostile.workload_data().map(hostile.as_yaml), hostile.raw_bytes()))
def test_workload_reader(content: bytes) -> None:
    _read(load_workload, _file("workload.yaml", content))


@READER_SETTINGS
@given(st.one_of(hostile.model_config_data().map(hostile.as_json), hostile.raw_bytes()))
def test_model_config_reader(content: bytes) -> None:
    _read(load_model, _file("model/config.json", content))


@READER_SETTINGS
@given(st.one_of(hostile.profile_data().map(hostile.as_json), hostile.raw_bytes()))
def test_profile_reader(content: bytes) -> None:
    _read(load_profile, _file("profile.json", content))


@READER_SETTINGS
@given(
    st.one_of(
        hostile.trace_rows().map(hostile.as_csv).map(lambda c: ("trace.csv", c)),
        hostile.trace_rows().map(hostile.as_jsonl).map(lambda c: ("trace.jsonl", c)),
        st.tuples(st.sampled_from(["trace.csv", "trace.jsonl"]), hostile.raw_bytes()),
    )
)
def test_trace_reader(named: tuple[str, bytes]) -> None:
    _read(load_trace, _file(*named))


@READER_SETTINGS
@given(
    st.one_of(
        hostile.VALUES.map(lambda v: {"version": 1, "stages": v}).map(hostile.as_json), hostile.raw_bytes()
    )
)
def test_plan_readers(content: bytes) -> None:
    path = _file("plan.json", content)
    _read(load_plan, path)
    _read(load_plan_pipeline, path)


@CLI_SETTINGS
@given(st.one_of(hostile.cluster_data().map(hostile.as_yaml), hostile.raw_bytes()))
def test_chunk_cli_with_hostile_cluster(content: bytes) -> None:
    path = _file("cli/cluster.yaml", content)
    succeeds_or_user_error(
        ["chunk", "--model", "llama-3-8b", "--cluster", path, "--stages", "2", "--seq-len", "512"]
    )


@CLI_SETTINGS
@given(st.one_of(hostile.model_config_data().map(hostile.as_json), hostile.raw_bytes()))
def test_chunk_cli_with_hostile_model(content: bytes) -> None:
    path = _file("cli/model/config.json", content)
    succeeds_or_user_error(
        ["chunk", "--model", path.parent, "--stages", "2", "--seq-len", "512", "--grid", "64"]
    )


@CLI_SETTINGS
@given(st.one_of(hostile.profile_data().map(hostile.as_json), hostile.raw_bytes()))
def test_chunk_cli_with_hostile_profile(content: bytes) -> None:
    path = _file("cli/profile.json", content)
    args = ["chunk", "--model", "llama-3-8b", "--stages", "2", "--seq-len", "512", "--profile", path]
    succeeds_or_user_error(args)


@CLI_SETTINGS
@given(
    st.one_of(
        hostile.trace_rows().map(hostile.as_csv).map(lambda c: ("cli/t.csv", c)),
        hostile.trace_rows().map(hostile.as_jsonl).map(lambda c: ("cli/t.jsonl", c)),
        hostile.workload_data().map(hostile.as_yaml).map(lambda c: ("cli/w.yaml", c)),
        st.tuples(st.sampled_from(["cli/t.csv", "cli/t.jsonl", "cli/w.yaml"]), hostile.raw_bytes()),
    )
)
def test_simulate_cli_with_hostile_workload(named: tuple[str, bytes]) -> None:
    plan = _FOLDER / "cli-plan.json"
    if not plan.exists():
        _write_small_plan(plan)
    path = _file(*named)
    succeeds_or_user_error(["simulate", "--plan", plan, "--workload", path, "--requests", "3"])


@settings(CLI_SETTINGS, max_examples=10)
@given(st.one_of(hostile.cluster_data().map(hostile.as_yaml), hostile.workload_data().map(hostile.as_yaml)))
def test_plan_cli_with_hostile_files(content: bytes) -> None:
    cluster, workload = "llmpq-t4-v100", "default"
    if b"nodes" in content:
        cluster = _file("cli/plan-cluster.yaml", content)
    else:
        workload = _file("cli/plan-workload.yaml", content)
    args = ["plan", "--model", "llama-2-7b", "--cluster", cluster, "--workload", workload]
    succeeds_or_user_error([*args, "--solver", "dp", "--time-limit", "2"], guard_s=60)


def _write_small_plan(path: Path) -> None:
    import json

    stages = [
        {"index": 0, "device": "a/gpu0", "gpu_type": "A100-80G", "unit_start": 0, "unit_end": 16,
         "layer_start": 0, "layer_end": 16, "link_to_next": {"bandwidth_gbps": 25.0, "latency_us": 20.0},
         "kv_gib": 8.0},
        {"index": 1, "device": "b/gpu0", "gpu_type": "V100-32G", "unit_start": 16, "unit_end": 32,
         "layer_start": 16, "layer_end": 32, "link_to_next": None, "kv_gib": 8.0},
    ]  # fmt: skip
    document = {"version": 1, "model": {"name": "llama-2-7b"}, "cluster": {"name": "hand"}, "dtype": "fp16",
                "kv_dtype": "fp16", "granularity": "layer", "stages": stages}  # fmt: skip
    path.write_text(json.dumps(document))
