"""`tessel serve` refuses bad options before it loads the model, and exits when its engine is dead."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from tessel.cli import app
from tessel.errors import TesselError
from tessel.ports import port_of, reserve_port

TIMEOUT_S = 60.0


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    from tessel.engine import llm_engine

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", refuse)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("nan", "NaN is not a number"),
        ("0", "0 is below 1e-06"),
        ("-1", "-1 is below"),
        ("inf", "inf is not finite"),
    ],
)
def test_kv_cache_gib_must_be_finite_and_above_its_floor(
    tiny_model: Path, no_model_load: None, value: str, said: str
) -> None:
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model), "--kv-cache-gib", value])
    message = " ".join(result.output.replace("\u2502", " ").split())
    assert result.exit_code == 2 and f"'--kv-cache-gib': {said}" in message, message


def test_kv_cache_gib_above_the_available_memory_names_both(tiny_model: Path, no_model_load: None) -> None:
    from tessel.engine.memory import available_memory_bytes

    available = available_memory_bytes("cpu")
    if available is None:
        pytest.skip("this system does not report its available memory")
    asked_gib = 2 * available / 2**30 + 1
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model), "--kv-cache-gib", str(asked_gib)])
    assert isinstance(result.exception, TesselError), result.output
    message = str(result.exception)
    assert f"{asked_gib:g}" in message and "GiB" in message and "available" in message


def test_unknown_log_level_is_a_usage_error_before_loading(tiny_model: Path, no_model_load: None) -> None:
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model), "--log-level", "loud"])
    assert result.exit_code == 2
    assert "loud" in result.output


@pytest.mark.parametrize("option", ["--max-body-bytes", "--max-prompt-chars", "--max-prompt-tokens"])
def test_limits_must_be_positive(tiny_model: Path, no_model_load: None, option: str) -> None:
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model), option, "0"])
    assert result.exit_code == 2 and option in result.output


@pytest.mark.parametrize("kind", ["closed", "pipe", "udp", "unbound"])
def test_listen_fd_must_be_a_bound_tcp_socket(tiny_model: Path, no_model_load: None, kind: str) -> None:
    import os

    held: list[Any] = []
    if kind == "closed":
        read, write = os.pipe()
        os.close(read), os.close(write)
        fd, said = read, "not an open socket"
    elif kind == "pipe":
        read, write = os.pipe()
        held += [read, write]
        fd, said = read, "not an open socket"
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if kind == "udp" else socket.SOCK_STREAM)
        held.append(sock)
        fd, said = sock.fileno(), "not a TCP socket" if kind == "udp" else "not bound to a port"
    try:
        result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model), "--listen-fd", str(fd)])
    finally:
        for thing in held:
            thing.close() if isinstance(thing, socket.socket) else os.close(thing)
    assert isinstance(result.exception, TesselError), result.output
    assert str(result.exception).startswith(f"--listen-fd {fd}: {said}"), str(result.exception)


def test_serve_exits_when_the_engine_cannot_restart(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, wait_until: Any
) -> None:
    """An engine whose every step fails: with --max-engine-restarts 0 the server stops, status 3."""
    from tessel.engine import llm_engine

    def broken_step(self: Any) -> list:
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(llm_engine.LLMEngine, "step", broken_step)
    listener = reserve_port()  # served through --listen-fd, which then owns (and closes) it
    port = port_of(listener)
    args = [
        "serve",
        "--model",
        str(tiny_model),
        "--listen-fd",
        str(listener.detach()),
        "--max-model-len",
        "64",
    ]
    args += ["--kv-cache-gib", "0.01", "--max-engine-restarts", "0", "--log-level", "warning"]
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(CliRunner().invoke(app, args)), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return not thread.is_alive()

    wait_until(up, "`tessel serve` to answer /health")
    failed = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT_S)
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_dead"
    thread.join(TIMEOUT_S)
    assert not thread.is_alive(), "the server did not exit after its engine died"
    assert isinstance(results[0].exception, TesselError) and results[0].exception.exit_code == 3
    assert "supervisor" in str(results[0].exception)


@pytest.mark.parametrize(
    ("args", "option", "expected"),
    [
        ([], "enforce_eager", False),
        (["--enforce-eager"], "enforce_eager", True),
        ([], "async_scheduling", False),
        (["--async-scheduling"], "async_scheduling", True),
        ([], "device", "cpu"),
        (["--device", "cuda:1"], "device", "cuda:1"),
    ],
)
def test_engine_options_reach_the_engine(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], option: str, expected: Any
) -> None:
    from tessel.engine import llm_engine

    seen: dict[str, Any] = {}

    def record(self: Any, *_args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise TesselError("stop after the engine's options")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", record)
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model), *args])
    assert isinstance(result.exception, TesselError), result.output
    assert seen[option] == expected and type(seen[option]) is type(expected)


def test_a_device_without_cuda_is_refused_by_name(tiny_model: Path) -> None:
    """This PyTorch (the CPU wheel in CI) sees no GPU: a TesselError (exit 2 from `tessel`) with the
    reason, before serving."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model), "--device", "cuda"])
    assert isinstance(result.exception, TesselError) and "sees no CUDA GPU" in str(result.exception)


def test_device_with_a_plan_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    result = CliRunner().invoke(
        app, ["serve", "--model", str(tiny_model), "--plan", str(plan), "--device", "cuda"]
    )
    assert isinstance(result.exception, TesselError)
    assert "--device cuda cannot be combined with --plan" in str(result.exception)


def test_serve_warms_up_the_engine_first(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tessel.engine import llm_engine

    def stop(self: Any) -> bool:
        raise TesselError("warmed up")

    def serve(self: Any) -> None:
        raise AssertionError("the server ran before the engine warmed up")

    import uvicorn

    monkeypatch.setattr(llm_engine.LLMEngine, "warm_up", stop)
    monkeypatch.setattr(uvicorn.Server, "run", serve)
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model)])
    assert isinstance(result.exception, TesselError) and "warmed up" in str(result.exception)
