"""`tessel serve --plan` when a stage stops answering or dies: the server stays up, `/health` answers
503 naming the stage while it rebuilds the pipeline, requests get 503 with Retry-After (never a
hang, never a refused connection), then it serves again; past `--max-engine-restarts` it answers
503 for good, and no stage process is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pipeline_plans import write_plan
from serve_process import start_serving
from stage_processes import alive, release

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from tessel.pipeline.options import RunOptions  # noqa: E402
from tessel.pipeline.supervision.supervisor import Supervisor  # noqa: E402
from tessel.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.slow  # processes started and killed: the slow pass of CI runs these

HEARTBEAT_TIMEOUT_S = 3.0  # short, so the test stays cheap (the default is 30 s)
DEADLINE_S = 60.0  # generous: a loaded 2-core machine
BODY = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


def _wait(condition, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)  # a poll interval


def _post_within_deadline(client: TestClient, body: dict) -> httpx.Response:
    """POST a completion from another thread; fail the test if it has no answer by the deadline
    (the TestClient has no timeout of its own)."""
    answer: dict = {}
    thread = threading.Thread(
        target=lambda: answer.update(response=client.post("/v1/completions", json=body)), daemon=True
    )
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), "the request hung"
    return answer["response"]


def _complete(client: TestClient | httpx.Client) -> str:
    response = client.post("/v1/completions", json=BODY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_stopped_stage_is_noticed_named_and_rebuilt(tiny_dirs, tmp_path):
    """SIGSTOP of stage 1 while a request runs (a deadlock looks the same): while the pipeline is
    rebuilt on the stage left (stage 0 alone) /health names stage 1's silence with Retry-After and a
    new request waits; then the running request, moved into the new pipeline, completes without an
    error, and the waiting one answers as the old pipeline did."""
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 3), (3, 5)])
    options = RunOptions(plan, model, heartbeat_timeout=HEARTBEAT_TIMEOUT_S)
    engine = Supervisor.serve(options, max_rebuilds=1)
    first = engine.executor
    pids = [proc.pid for proc in first.stages.procs]
    app = create_app(engine, max_pending=8)
    async_engine = app.state.async_engine
    try:
        dead_calls: list[bool] = []
        async_engine.on_dead = lambda: dead_calls.append(True)
        gate = threading.Event()  # holds the rebuild, so the test sees the server while it rebuilds
        replacement = engine.supervisor._replacement
        engine.supervisor._replacement = lambda options: (gate.wait(DEADLINE_S), replacement(options))[1]
        with TestClient(app) as client:
            try:
                before = _complete(client)
                running: dict = {}
                long_body = {**BODY, "max_tokens": 900, "ignore_eos": True}
                thread = threading.Thread(
                    target=lambda: running.update(r=_post_within_deadline(client, long_body)), daemon=True
                )
                thread.start()
                _wait(
                    lambda: engine.has_unfinished_requests() or not thread.is_alive(), "the request to start"
                )
                os.kill(pids[0], signal.SIGSTOP)
                _wait(lambda: client.get("/health").status_code == 503, "/health to report the silent stage")
                health = client.get("/health")
                assert "restarting" in health.text and int(health.headers["Retry-After"]) >= 1
                # the watchdog reads the stop in /proc and names it; a heartbeat starved past the
                # timeout on a loaded machine just before the stop is named as the silence it was
                named = (f"is stopped (SIGSTOP or a debugger) for {HEARTBEAT_TIMEOUT_S:g} s",
                         f"no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s")  # fmt: skip
                assert "stage 1" in health.text and any(cause in health.text for cause in named)
                later: dict = {}
                waiting = threading.Thread(
                    target=lambda: later.update(r=_post_within_deadline(client, BODY)), daemon=True
                )
                waiting.start()
                assert client.get("/v1/models").status_code == 200
                assert "r" not in running and "r" not in later  # both wait for the new pipeline
                gate.set()
                thread.join(DEADLINE_S * 2)
                waiting.join(DEADLINE_S * 2)
                assert running["r"].status_code == 200, running["r"].text
                answer = running["r"].json()
                assert answer["choices"][0]["finish_reason"] == "length"
                assert answer["usage"]["completion_tokens"] == 900
                assert later["r"].status_code == 200 and later["r"].json()["choices"][0]["text"] == before
                assert client.get("/health").status_code == 200
                assert _complete(client) == before
                assert not any(alive(pid) for pid in pids)  # the old stages
                assert engine.executor is not first and engine.supervisor.num_rebuilds == 1
                assert len(engine.executor.plan.stages) == 1  # stage 0's device alone holds the model
            finally:
                gate.set()  # a failed check above must not leave the request waiting on the gate
        assert dead_calls == []
    finally:
        release(pids)
        engine.supervisor.close()


def _children(pid: int) -> set[int]:
    """Child processes of every thread of `pid` (stages rebuilt by the engine thread are its children)."""
    children: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as listed:
            children.update(int(child) for child in listed.read().split())
    return children


def _stage_pid(pids: set[int], rank: int) -> int:
    """The stage process of `rank` among `pids` (its RANK environment variable)."""
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            if f"RANK={rank}".encode() in environ.read().split(b"\0"):
                return pid
    raise AssertionError(f"no stage {rank} among {sorted(pids)}")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the stage through /proc")
def test_killed_stage_is_rebuilt_then_503_for_good_past_the_budget(tiny_dirs, tmp_path):
    """`kill -9` of stage 1 of 3 under `tessel serve --plan --max-engine-restarts 1`: /health names
    the stage, then the server is back on the two stages left (a new stage 1) and answers as before.
    A second kill is past the budget: the server stays up (it used to exit: connection refused),
    /health and completions answer 503 with the reason, /v1/models answers. No stage process
    outlives the server."""
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 4), (4, 5)])
    command = [sys.executable, "-m", "tessel.cli", "serve", "--model", str(model), "--plan", str(plan)]
    command += ["--log-level", "warning", "--max-engine-restarts", "1"]
    server, url = start_serving(command, stderr=subprocess.PIPE, text=True)
    stage_pids: set[int] = set()
    try:
        with httpx.Client(base_url=url, timeout=DEADLINE_S) as client:

            def health() -> httpx.Response | None:
                assert server.poll() is None, server.stderr.read()
                try:
                    return client.get("/health")
                except httpx.TransportError:
                    return None

            _wait(lambda: (r := health()) is not None and r.status_code == 200, "the server to start")
            before = _complete(client)
            first = _children(server.pid)
            stage_pids |= first
            assert len(first) == 2
            os.kill(_stage_pid(first, 1), signal.SIGKILL)
            _wait(lambda: health().status_code == 503, "/health to report the dead stage")
            failed = health()
            assert "stage 1" in failed.text and "SIGKILL" in failed.text, failed.text
            _wait(lambda: health().status_code == 200, "the rebuilt pipeline")
            assert _complete(client) == before
            second = _children(server.pid)
            stage_pids |= second
            assert len(second) == 1 and not second & stage_pids - second
            os.kill(second.pop(), signal.SIGKILL)
            _wait(lambda: "no restarts are left" in health().text, "/health to give up")
            for _ in range(2):
                response = client.post("/v1/completions", json=BODY)
                assert response.status_code == 503 and "stage 1" in response.text
                assert "Retry-After" not in response.headers
                time.sleep(0.5)  # a poll interval: the server used to exit within 3 s
            dead = health()
            assert dead.status_code == 503 and "stage 1" in dead.text and "SIGKILL" in dead.text
            assert client.get("/v1/models").status_code == 200
            assert server.poll() is None
            stage_pids |= _children(server.pid)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        survivors = [pid for pid in stage_pids if alive(pid)]
        release(stage_pids)
    assert survivors == [], f"stage processes outlived the server: {survivors}"


def test_heartbeat_timeout_needs_a_plan(tiny_dirs):
    from typer.testing import CliRunner

    from tessel.cli import app
    from tessel.errors import TesselError

    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_dirs["tied"]), "--heartbeat-timeout", "5"])
    assert isinstance(result.exception, TesselError) and result.exception.exit_code == 2
    assert "give --plan too" in str(result.exception)
