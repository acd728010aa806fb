"""Fixtures for the server tests: a tiny checkpoint, bounded polling, a uvicorn server in a thread.

Servers bind to 127.0.0.1 on a port the OS picks, and every wait polls a condition under a
bounded deadline (no sleeps for synchronisation). The helpers are handed out as fixtures because
the suite imports test modules with `--import-mode=importlib` (no test directory on sys.path).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")

DEADLINE_S = 60.0  # upper bound on any wait; the tests normally pass their polls in milliseconds
POLL_S = 0.01


def wait_until(condition: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
    """Poll `condition` until it holds; fail naming `what` after `deadline_s`."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)  # a poll interval, not a synchronisation sleep


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Run `app` under uvicorn on 127.0.0.1 (free port) in a thread; yield its base URL."""
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
        assert server.started, "uvicorn did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=DEADLINE_S)
        assert not thread.is_alive(), "uvicorn did not stop"


@contextmanager
def engine_paused(async_engine: Any) -> Iterator[None]:
    """Hold the engine thread inside a command while the block runs: no step, add or abort happens.

    Makes "the request is still running when the client leaves" and "the server is full"
    deterministic instead of a race against the generation speed.
    """
    started, release = threading.Event(), threading.Event()
    future = async_engine.submit(lambda: (started.set(), release.wait(DEADLINE_S)))
    try:
        assert started.wait(DEADLINE_S), "the engine thread did not pick up the pause"
        yield
    finally:
        release.set()
        future.result(timeout=DEADLINE_S)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("server") / "tiny-llama", arch="llama")


@pytest.fixture(name="wait_until", scope="session")
def _wait_until_fixture() -> Callable[..., None]:
    return wait_until


@pytest.fixture(name="serve_in_thread", scope="session")
def _serve_in_thread_fixture() -> Callable[[Any], Any]:
    return serve_in_thread


@pytest.fixture(name="engine_paused", scope="session")
def _engine_paused_fixture() -> Callable[[Any], Any]:
    return engine_paused
