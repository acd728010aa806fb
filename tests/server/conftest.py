"""Fixtures for the server tests: a tiny checkpoint, bounded polling, a uvicorn server in a thread,
and the engine behind the server in both kinds `tessel serve` runs.

Servers bind to 127.0.0.1 on a port the OS picks, and every wait polls a condition under a
bounded deadline (no sleeps for synchronisation). The helpers are handed out as fixtures because
the suite imports test modules with `--import-mode=importlib` (no test directory on sys.path).

A module whose `engine` fixture is built with `make_engine` runs once per engine kind: `single`
(one process's `LLMEngine`, `tessel serve`) and `pipeline` (`tessel serve --plan`: a 2-stage CPU
plan of the same checkpoint, this process stage 0 and stage 1 a child process over gloo, two
micro-batches in flight). The same tests, with the same oracles, hold for both. Tests marked
`single_engine` (request validation, which never reaches the engine) run on the single one only.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
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


ENGINE_KINDS = ("single", "pipeline")
PIPELINE_SLOTS = 2  # the plan's micro-batches in flight (one scheduler each)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "single_engine: run on the single-process engine kind only")


def _pipeline_run_of_single_engine_test(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    kind = None if callspec is None else callspec.params.get("engine_kind")
    return kind == "pipeline" and item.get_closest_marker("single_engine") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the pipeline runs of tests marked `single_engine`."""
    dropped = [item for item in items if _pipeline_run_of_single_engine_test(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not _pipeline_run_of_single_engine_test(item)]


@contextmanager
def build_engine(
    kind: str, model: Path, work_dir: Path, *, max_num_seqs: int, **options: Any
) -> Iterator[Any]:
    """The engine a server drives. `max_num_seqs` bounds the sequences running at once in both kinds:
    the pipeline's `PIPELINE_SLOTS` schedulers get an equal share each."""
    if kind == "single":
        from tessel.engine.llm_engine import LLMEngine

        yield LLMEngine(str(model), max_num_seqs=max_num_seqs, **options)
        return
    from pipeline_plans import write_plan
    from tessel.pipeline.serving import pipeline_server_engine

    assert kind == "pipeline" and max_num_seqs % PIPELINE_SLOTS == 0, (kind, max_num_seqs)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    split = [(0, layers // 2), (layers // 2, layers)]
    plan = write_plan(work_dir / "plan.json", model, split, micro_batches=PIPELINE_SLOTS)
    engine = pipeline_server_engine(model, plan, max_num_seqs=max_num_seqs // PIPELINE_SLOTS, **options)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def engine_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def make_engine(
    engine_kind: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., AbstractContextManager[Any]]:
    """`with make_engine(max_num_seqs=..., **engine options) as engine`: this module's engine kind."""
    return functools.partial(build_engine, engine_kind, tiny_model, tmp_path_factory.mktemp(engine_kind))


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
