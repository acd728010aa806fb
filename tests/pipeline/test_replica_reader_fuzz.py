"""Hostile `--replica` values and stage precisions against the runtime's plan reader
(`load_run_plan`): a RunPlan or a TesselError, never a traceback; the CLI refuses out of range
before any process starts, exit code 2, and names the replicas' weights without `--replica`."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from pipeline_plans import write_plan
from tessel.cli import app
from tessel.errors import TesselError
from tessel.pipeline.run_plan import load_run_plan
from tessel.pipeline.supervision import launcher

PRECISION_NAMES = st.sampled_from(["fp32", "fp16", "bf16", "int8", "int4", "int3", "", "INT8", "fp8"])


def replica_plan(tmp_path, model):
    """Replica 0: layers 0-2 / 2-5 on cpu0, cpu1 (weight 0.6); replica 1: 0-1 / 1-4 / 4-5 on
    cpu2..cpu4 (weight 0.4), its last stage int8."""
    first = json.loads(write_plan(tmp_path / "a.json", model, [(0, 2), (2, 5)]).read_text())
    second = json.loads(write_plan(tmp_path / "b.json", model, [(0, 1), (1, 4), (4, 5)]).read_text())
    for offset, stage in enumerate(second["stages"]):
        stage["device"] = f"localhost/cpu{2 + offset}"
    second["stages"][2]["precisions"] = ["int8"]
    plan = {**first, "version": 2, "precisions": ["fp32", "int8"]}
    plan["replicas"] = [
        {"index": 0, "weight": 0.6, "stages": first["stages"]},
        {"index": 1, "weight": 0.4, "stages": second["stages"]},
    ]
    path = tmp_path / "replicas.json"
    path.write_text(json.dumps(plan))
    return path


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    replica=st.one_of(st.none(), st.integers(-(2**40), 2**40)),
    names=st.lists(PRECISION_NAMES, min_size=0, max_size=4),
    weight=st.floats(allow_nan=True, allow_infinity=True),
)
def test_fuzz_replica_and_precisions_read_or_refuse(tiny_dirs, tmp_path, replica, names, weight):
    plan = json.loads(replica_plan(tmp_path, tiny_dirs["tied"]).read_text())
    plan["replicas"][1]["stages"][1]["precisions"] = names
    plan["replicas"][0]["weight"] = weight
    path = tmp_path / "fuzz.json"
    path.write_text(json.dumps(plan, allow_nan=True))
    try:
        run_plan = load_run_plan(path, replica)
    except TesselError:
        return
    assert replica in (0, 1) and len(run_plan.stages) == (2, 3)[replica]


def _no_spawn(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker was spawned for a bad --replica")

    monkeypatch.setattr(launcher, "spawn_worker", refuse)


@pytest.mark.parametrize("replica", [None, 2, -1, 7])
def test_cli_refuses_a_missing_or_out_of_range_replica(tiny_dirs, tmp_path, monkeypatch, replica):
    _no_spawn(monkeypatch)
    model = tiny_dirs["tied"]
    plan = replica_plan(tmp_path, model)
    argv = ["launch", "--plan", str(plan), "--model", str(model), "--prompt", "x"]
    argv += [] if replica is None else ["--replica", str(replica)]
    result = CliRunner().invoke(app, argv)
    if replica is not None and replica < 0:  # typer's range check (min=0): a usage error, exit 2
        assert result.exit_code == 2 and "--replica" in result.output
        return
    assert isinstance(result.exception, TesselError) and result.exception.exit_code == 2
    message = str(result.exception)
    if replica is None:
        assert "--replica K" in message and "0.600" in message and "0.400" in message
    else:
        assert "0..1" in message
