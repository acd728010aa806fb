"""`tessel serve --plan` when a stage stops answering or dies: the server stays up, `/health` answers
503 naming the stage, requests get 503 (never a hang, never a refused connection), the restart
budget is not spent, and no stage process is left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pipeline_plans import write_plan

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from tessel.pipeline.serving import pipeline_server_engine  # noqa: E402
from tessel.server.app import create_app  # noqa: E402

HEARTBEAT_TIMEOUT_S = 3.0  # short, so the test stays cheap (the default is 30 s)
DEADLINE_S = 60.0  # generous: a loaded 2-core machine
BODY = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(condition, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)  # a poll interval


def _release(pids: list[int]) -> None:
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break


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


def test_stopped_stage_is_noticed_and_named(tiny_dirs, tmp_path):
    """SIGSTOP of stage 1 while a request runs (a deadlock looks the same): that request ends with
    503 instead of hanging, /health names stage 1's silence, new requests get 503 at once."""
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 3), (3, 5)])
    engine = pipeline_server_engine(model, plan, heartbeat_timeout=HEARTBEAT_TIMEOUT_S)
    pids = [proc.pid for proc in engine.stages.procs]
    try:
        app = create_app(engine, max_pending=8)
        async_engine = app.state.async_engine
        dead_calls: list[bool] = []
        async_engine.on_dead = lambda: dead_calls.append(True)
        engine.watch_stages(async_engine)
        with TestClient(app) as client:
            assert client.post("/v1/completions", json=BODY).status_code == 200
            running: dict = {}
            long_body = {**BODY, "max_tokens": 900, "ignore_eos": True}
            thread = threading.Thread(
                target=lambda: running.update(r=_post_within_deadline(client, long_body)), daemon=True
            )
            thread.start()
            _wait(lambda: engine.has_unfinished_requests() or not thread.is_alive(), "the request to start")
            os.kill(pids[0], signal.SIGSTOP)
            thread.join(DEADLINE_S * 2)
            assert "r" in running, "the running request hung on the stopped stage"
            assert running["r"].status_code == 503, running["r"].text
            health = client.get("/health")
            assert health.status_code == 503
            assert "stage 1" in health.text and f"no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s" in health.text
            later = _post_within_deadline(client, BODY)
            assert later.status_code == 503 and "stage 1" in later.text
            assert client.get("/v1/models").status_code == 200
        assert dead_calls == [] and async_engine.num_restarts == 0
        _wait(lambda: not any(_alive(pid) for pid in pids), "the stage processes to be stopped")
    finally:
        _release(pids)
        engine.close()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [int(child) for child in children.read().split()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the stage through /proc")
def test_killed_stage_leaves_the_server_up(tiny_dirs, tmp_path):
    """`kill -9` of stage 1 under `tessel serve --plan`: the server process stays up (it used to spend
    its restart budget in 3 s and exit: connection refused); /health names the stage, /v1/models
    answers, completions get 503."""
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 3), (3, 5)])
    port = _free_port()
    command = [sys.executable, "-m", "tessel.cli", "serve", "--model", str(model), "--plan", str(plan)]
    command += ["--port", str(port), "--log-level", "warning", "--max-engine-restarts", "1"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    stage_pids: list[int] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=DEADLINE_S) as client:

            def up() -> bool:
                assert server.poll() is None, server.stderr.read()
                try:
                    return client.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            _wait(up, "the server to start")
            assert client.post("/v1/completions", json=BODY).status_code == 200
            stage_pids = _children(server.pid)
            assert len(stage_pids) == 1
            os.kill(stage_pids[0], signal.SIGKILL)
            _wait(lambda: client.get("/health").status_code == 503, "/health to report the dead stage")
            for _ in range(3):  # more failures than --max-engine-restarts: still up
                response = client.post("/v1/completions", json=BODY)
                assert response.status_code == 503 and "stage 1" in response.text
                time.sleep(0.5)  # a poll interval: the server had exited within 3 s
            health = client.get("/health")
            assert "stage 1" in health.text and "SIGKILL" in health.text
            assert client.get("/v1/models").status_code == 200
            assert server.poll() is None
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        _release(stage_pids)


def test_heartbeat_timeout_needs_a_plan(tiny_dirs):
    from typer.testing import CliRunner

    from tessel.cli import app
    from tessel.errors import TesselError

    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_dirs["tied"]), "--heartbeat-timeout", "5"])
    assert isinstance(result.exception, TesselError) and result.exception.exit_code == 2
    assert "give --plan too" in str(result.exception)
