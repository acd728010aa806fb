"""Faults: a dead stage ends the whole run with an error naming it and the cause, no process left
behind; bad plans are refused before any process starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from pipeline_plans import write_plan
from stage_processes import alive, release
from tessel.cli import app
from tessel.errors import TesselError
from tessel.pipeline.run import RunOptions, check_options, run_pipeline
from tessel.pipeline.supervision import launcher
from tessel.pipeline.supervision.launcher import StageFailedError

pytestmark = pytest.mark.slow  # processes started and killed: the slow pass of CI runs these

READY_TIMEOUT_S = 240  # three stage processes importing torch on a loaded machine
FAULT_DEADLINE_S = 30  # the bound: everything stops within 30 s of the death


def _wait_ready(run_dir, num_stages: int) -> list[int]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        statuses = [launcher.read_status(run_dir, rank) for rank in range(num_stages)]
        if all(s.get("state") == "ready" for s in statuses):
            return [s["pid"] for s in statuses]
        time.sleep(0.2)
    raise AssertionError(f"stages not ready: {statuses}")


def test_killed_middle_stage_ends_the_run(tiny_dirs, tmp_path):
    model = tiny_dirs["untied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 4), (4, 6)])
    run_dir = tmp_path / "run"
    options = RunOptions(
        plan, model, prompts=["Hello world"] * 4, max_tokens=1000, ignore_eos=True, run_dir=run_dir
    )
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = run_pipeline(options)
        except BaseException as error:  # noqa: BLE001 - inspected below
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    pids = _wait_ready(run_dir, 3)
    os.kill(pids[1], signal.SIGKILL)
    thread.join(timeout=FAULT_DEADLINE_S)
    assert not thread.is_alive(), "the launcher did not stop within 30 s of the death"
    error = outcome.get("error")
    assert isinstance(error, StageFailedError), outcome
    assert error.stage == 1 and "SIGKILL" in error.cause
    assert "stage 1" in str(error)
    assert not any(alive(pid) for pid in pids)


def test_exception_in_a_stage_is_named(tiny_dirs, tmp_path, monkeypatch):
    """A model missing a tensor is refused before any stage starts; when only stage 2 sees it (its
    copy of the model lacks the tensor), stage 2 fails and the run names it and why."""
    good = tiny_dirs["tied"]
    broken = tmp_path / "broken" / good.name  # the same name: the plan fits both
    broken.mkdir(parents=True)
    for item in good.iterdir():
        if item.suffix != ".safetensors":
            (broken / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(good / "model.safetensors"))
    del tensors["model.layers.4.mlp.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    plan = write_plan(tmp_path / "plan.json", good, [(0, 2), (2, 4), (4, 5)])
    with monkeypatch.context() as patch:
        _no_spawn(patch)
        with pytest.raises(TesselError, match="model.layers.4.mlp.down_proj.weight"):
            run_pipeline(RunOptions(plan, broken, prompts=["Hello"], max_tokens=4, run_dir=tmp_path / "r0"))
    spawn = launcher.spawn_worker

    def stage_2_gets_the_broken_copy(rank, world_size, port, run_dir, options_file, *rest):  # noqa: ANN001, ANN002, ANN202
        if rank == 2:
            options = json.loads(options_file.read_text())
            assert options["model"] == str(good)
            options_file = run_dir / "stage2-options.json"
            options_file.write_text(json.dumps({**options, "model": str(broken)}))
        return spawn(rank, world_size, port, run_dir, options_file, *rest)

    monkeypatch.setattr(launcher, "spawn_worker", stage_2_gets_the_broken_copy)
    with pytest.raises(StageFailedError) as caught:
        run_pipeline(RunOptions(plan, good, prompts=["Hello"], max_tokens=4, run_dir=tmp_path / "run"))
    assert caught.value.stage == 2
    assert "model.layers.4.mlp.down_proj.weight" in caught.value.cause


def _sublayer_split(plan: dict) -> None:
    """Layer 1's attention on stage 0, its MLP on stage 1."""
    plan["granularity"] = "sublayer"
    plan["stages"][0].update(unit_start=0, unit_end=3, layer_start=0, layer_end=2)
    plan["stages"][1].update(unit_start=3, unit_end=10, layer_start=1, layer_end=5)


def _no_spawn(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker was spawned for a bad plan")

    monkeypatch.setattr(launcher, "spawn_worker", refuse)


def _edit(path, edit) -> None:
    plan = json.loads(path.read_text())
    edit(plan)
    path.write_text(json.dumps(plan))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: p["model"]["config"].update(num_hidden_layers=30), "the plan is for 30 layers"),
        (lambda p: p["model"].update(name="llama-3-8b"), "the plan is for 'llama-3-8b'"),
        (lambda p: p.update(version=7), "plan version 7 is not supported"),
        (_sublayer_split, "splits a decoder layer"),
        (lambda p: p["stages"][1].update(gpu_type="A100-80G"), "(A100-80G), but this machine has"),
        (lambda p: p["stages"][1].update(precisions=["fp16", "int9", "int8"]), "not a weight precision"),
        (lambda p: p["stages"][1].update(layer_end=4, unit_end=4), "5 layers, the plan covers 4"),
        (lambda p: p["stages"][0].update(layer_end=0, unit_end=0), "holds no units"),
        (lambda p: p["stages"][1].update(emulate_speed=2.0), "emulate_speed"),
        (lambda p: p["stages"].pop(), "5 layers, the plan covers 2"),
    ],
)
def test_bad_plans_are_refused_before_any_process(tiny_dirs, tmp_path, monkeypatch, edit, message):
    _no_spawn(monkeypatch)
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)])
    _edit(plan, edit)
    with pytest.raises(TesselError) as caught:
        run_pipeline(RunOptions(plan, model, prompts=["Hello"]))
    assert message in str(caught.value)


def test_cli_refuses_a_bad_plan_with_exit_code_2(tiny_dirs, tmp_path, monkeypatch):
    _no_spawn(monkeypatch)
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)])
    _edit(plan, lambda p: p["model"]["config"].update(num_hidden_layers=12))
    result = CliRunner().invoke(app, ["launch", "--plan", str(plan), "--model", str(model), "--prompt", "x"])
    assert result.exit_code != 0
    assert isinstance(result.exception, TesselError) and result.exception.exit_code == 2
    assert "12 layers" in str(result.exception)


def test_ctrl_c_stops_every_stage(tiny_dirs, tmp_path):
    """SIGINT to the launcher's process group (what Ctrl-C sends): all stages stop, exit code 130."""
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)])
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "tessel.cli", "launch", "--plan", str(plan), "--model", str(model)]
    command += ["--prompt", "Hello", "--max-tokens", "1000", "--ignore-eos", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(command, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        pids = _wait_ready(run_dir, 2)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=FAULT_DEADLINE_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr
    assert not any(alive(pid) for pid in pids)


plan_edits = st.lists(
    st.tuples(
        st.sampled_from(
            ["layer_start", "layer_end", "unit_start", "unit_end", "emulate_speed", "gpu_type", "device"]
        ),
        st.integers(0, 1),
        st.one_of(
            st.integers(-3, 9), st.floats(allow_nan=True), st.text(max_size=6), st.none(), st.booleans()
        ),
    ),
    max_size=4,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=plan_edits, version=st.sampled_from([1, 1, 1, 0, 2, "1", None]))
def test_fuzz_plans_only_tessel_errors(tiny_dirs, tmp_path, edits, version):
    """Random edits of a valid plan: the runtime's checks accept it or raise TesselError, never more."""
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "fuzz.json", model, [(0, 2), (2, 5)])
    data = json.loads(plan.read_text())
    data["version"] = version
    for field, stage, value in edits:
        data["stages"][stage][field] = value
    plan.write_text(json.dumps(data))
    try:
        check_options(RunOptions(plan, model, prompts=["Hello"]))
    except TesselError:
        pass


# ---- liveness: a stage that stops answering ends the run like a dead one ------------------------------
HEARTBEAT_TIMEOUT_S = 3.0  # short, so these tests stay cheap (the default is 30 s)


def _run_in_thread(options: RunOptions) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = run_pipeline(options)
        except BaseException as error:  # noqa: BLE001 - inspected by the test
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.slow
def test_stopped_stage_ends_the_run_named(tiny_dirs, tmp_path):
    """SIGSTOP of stage 1 mid-generation (a hang looks the same): the run fails within the heartbeat
    timeout naming stage 1's silence, and every stage process is gone (the stopped one included)."""
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)])
    run_dir = tmp_path / "run"
    options = RunOptions(
        plan,
        model,
        prompts=["Hello world"] * 4,
        max_tokens=1000,
        ignore_eos=True,
        run_dir=run_dir,
        heartbeat_timeout=HEARTBEAT_TIMEOUT_S,
    )
    thread, outcome = _run_in_thread(options)
    pids = _wait_ready(run_dir, 2)
    try:
        os.kill(pids[1], signal.SIGSTOP)
        thread.join(timeout=FAULT_DEADLINE_S)
        assert not thread.is_alive(), "the launcher did not notice the stopped stage"
    finally:
        release(pids)
    error = outcome.get("error")
    assert isinstance(error, StageFailedError), outcome
    # the watchdog names what it saw first: the process stopped, or its heartbeat silent
    said = (
        f"is stopped (SIGSTOP or a debugger) for {HEARTBEAT_TIMEOUT_S:g} s",
        f"sent no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s",
    )
    assert error.stage == 1 and any(cause in error.cause for cause in said), error.cause
    assert not any(alive(pid) for pid in pids)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["at spawn", "after its first beat"])
def test_a_stage_stopped_while_starting_ends_the_run_named(tiny_dirs, tmp_path, monkeypatch, when):
    """SIGSTOP of stage 1 before it has loaded (issue 42, finding 4): at spawn, before Python has
    even run, or once it beats while importing torch. The run fails within the fault bound naming
    stage 1, where the old start-up allowance waited 300 s."""
    from tessel.pipeline.supervision.heartbeat import read_beat

    spawn = launcher.spawn_worker
    stopped: list[int] = []

    def spawn_and_stop(rank, world_size, port, run_dir, argv, *rest):  # noqa: ANN001, ANN002, ANN202
        proc = spawn(rank, world_size, port, run_dir, argv, *rest)
        if rank == 1:
            while when != "at spawn" and read_beat(run_dir, 1) is None and proc.poll() is None:
                time.sleep(0.005)
            os.kill(proc.pid, signal.SIGSTOP)
            stopped.append(proc.pid)
        return proc

    monkeypatch.setattr(launcher, "spawn_worker", spawn_and_stop)
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)])
    options = RunOptions(
        plan,
        model,
        prompts=["Hello"],
        max_tokens=4,
        run_dir=tmp_path / "run",
        heartbeat_timeout=HEARTBEAT_TIMEOUT_S,
    )
    thread, outcome = _run_in_thread(options)
    try:
        thread.join(timeout=FAULT_DEADLINE_S + 30)  # the 30 s allowance of a stage importing torch
        assert not thread.is_alive(), "the launcher did not notice the stage stopped while starting"
    finally:
        release(stopped)
    error = outcome.get("error")
    assert isinstance(error, StageFailedError), outcome
    assert error.stage == 1 and ("is stopped" in error.cause or "no heartbeat" in error.cause), error.cause
    assert not any(alive(pid) for pid in stopped)


def test_cli_refuses_a_bad_heartbeat_timeout(tiny_dirs, tmp_path, monkeypatch):
    _no_spawn(monkeypatch)
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)])
    args = ["launch", "--plan", str(plan), "--model", str(model), "--prompt", "x"]
    result = CliRunner().invoke(app, [*args, "--heartbeat-timeout", "0"])
    message = " ".join(result.output.replace("\u2502", " ").split())
    assert result.exit_code == 2 and "'--heartbeat-timeout': 0 is below 0.5" in message, message
    monkeypatch.setenv("TESSEL_HEARTBEAT_TIMEOUT_S", "soon")
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, TesselError) and result.exception.exit_code == 2
    assert "TESSEL_HEARTBEAT_TIMEOUT_S='soon'" in str(result.exception)


@pytest.mark.parametrize(("field", "flag"), [("micro_batches", "--micro-batches"), ("threads", "--threads")])
def test_a_huge_count_is_refused_before_any_stage_starts(tiny_dirs, tmp_path, monkeypatch, field, flag):
    """Issue 42's fuzz: 1e30 micro-batches filled stage 0's memory until the kernel killed it, and 1e30
    threads overflowed torch.set_num_threads in the stage."""
    _no_spawn(monkeypatch)
    plan = write_plan(tmp_path / "plan.json", tiny_dirs["tied"], [(0, 5)])
    options = RunOptions(plan, tiny_dirs["tied"], prompts=["x"], **{field: 10**30})
    with pytest.raises(TesselError, match=rf"{flag} must be in \[1, "):
        run_pipeline(options)
    result = CliRunner().invoke(
        app, ["launch", "--plan", str(plan), "--model", str(tiny_dirs["tied"]), flag, "10" * 15]
    )
    assert result.exit_code == 2 and flag in result.output
