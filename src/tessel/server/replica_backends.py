"""The backends of `tessel serve --plan P` over a plan of several replicas: one server per replica.

Each backend is `tessel serve --plan P --replica K` (one pipeline: its process is stage 0 and spawns
the replica's other stages), a child process on a free port of 127.0.0.1 (bound here and inherited,
`tessel.server.listen`, so nothing takes it while the model loads), its output in
`replica<K>.log` of the run directory. `start_backends` spawns them all and waits until each
answers `/health` with 200; a backend that exits first, or is not ready within
`BACKEND_READY_TIMEOUT_S`, stops them all and raises a TesselError naming the replica and why (its
exit and the last lines of its log). Backends die with the process that spawned them (Linux
`PR_SET_PDEATHSIG`, SIGTERM: each then stops its own stages); `stop_backends` terminates them
(SIGTERM, then SIGKILL after the launcher's grace period). This module imports no torch.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from tessel.errors import TesselError
from tessel.pipeline.supervision.launcher import POLL_S, die_with_parent, terminate
from tessel.ports import port_of, reserve_port
from tessel.server.listen import listen_address

# Loading a model's weights before the backend answers: 140 GB (a 70B model in bf16) at 200 MB/s
# from disk is 700 s; the rest is margin.
BACKEND_READY_TIMEOUT_S = 900.0
PROBE_TIMEOUT_S = 2.0  # one /health request to a backend on this machine
LOG_TAIL_LINES = 3


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One pipeline of the plan: its index and its routing weight (the plan's share of requests)."""

    index: int
    weight: float


class ServerProcess(Protocol):
    """What the router needs of a backend's process: a child here (`subprocess.Popen`) or one on
    another machine (`tessel.pipeline.ray_replicas.RemoteServer`)."""

    pid: int

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def send_signal(self, sig: int) -> None: ...


@dataclass(slots=True)
class Backend:
    """A replica's server process."""

    spec: ReplicaSpec
    proc: ServerProcess
    port: int
    log_path: Path
    max_model_len: int = 0  # from its /v1/models once ready
    host: str = "127.0.0.1"  # another machine's address when Ray placed it there
    node: str | None = None  # that machine's name (None: this machine)

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def exit_cause(self) -> str | None:
        """Why its process ended (the exit and its log's last lines), or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        where = "" if self.node is None else f" on node {self.node}"
        tail = getattr(self.proc, "log_tail", None)
        last = tail() if callable(tail) else log_tail(self.log_path)
        return f"its server process (pid {self.proc.pid}{where}) {describe_exit(code)}; {last}"


def describe_exit(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = str(-code)
    cause = f"was killed by signal {name}"
    if code == -signal.SIGKILL:
        cause += " (by hand or by the kernel's out-of-memory killer)"
    return cause


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return f"no log at {path}"
    tail = " | ".join(line.strip() for line in text[-lines:])
    return f"log {path}: {tail}" if tail else f"empty log {path}"


def backend_argv(model: Path, plan: Path, replica: int, options: list[str]) -> list[str]:
    """The command of replica `replica`'s server: `tessel serve` with the user's serve options;
    whoever starts it adds where it listens (`listen_argv`)."""
    return [
        sys.executable, "-m", "tessel.cli", "serve", "--model", str(model), "--plan", str(plan),
        "--replica", str(replica), *options,
    ]  # fmt: skip


def listen_argv(listener: socket.socket) -> list[str]:
    """The server's options to listen on `listener`, a socket reserved by its parent and inherited."""
    host, port = listen_address(listener)
    return ["--host", host, "--port", str(port), "--listen-fd", str(listener.fileno())]


SpawnBackend = Callable[[ReplicaSpec, Path], Backend]  # (replica, run directory) -> its started server


def local_backends(model: Path, plan: Path, options: list[str]) -> SpawnBackend:
    """Each replica's server as a child process of this one, on 127.0.0.1."""
    return lambda spec, run_dir: spawn_backend(spec, model, plan, options, run_dir)


def spawn_backend(spec: ReplicaSpec, model: Path, plan: Path, options: list[str], run_dir: Path) -> Backend:
    log_path = run_dir / f"replica{spec.index}.log"
    with reserve_port("127.0.0.1") as listener, open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*backend_argv(model, plan, spec.index, options), *listen_argv(listener)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(listener.fileno(),),
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
        )
        port = port_of(listener)
    return Backend(spec, proc, port, log_path)


def start_backends(
    specs: list[ReplicaSpec],
    spawn: SpawnBackend,
    run_dir: Path,
    ready_timeout_s: float = BACKEND_READY_TIMEOUT_S,
) -> list[Backend]:
    """Spawn every replica's server and return once all answer; on any failure stop them all."""
    run_dir.mkdir(parents=True, exist_ok=True)
    backends: list[Backend] = []
    try:
        for spec in specs:
            backends.append(spawn(spec, run_dir))
        wait_ready(backends, ready_timeout_s)
    except BaseException:
        stop_backends(backends)
        raise
    return backends


def wait_ready(backends: list[Backend], timeout_s: float) -> None:
    """Poll each backend's /health until 200 (then read its max_model_len from /v1/models)."""
    deadline = time.monotonic() + timeout_s
    pending = list(backends)
    with httpx.Client(timeout=PROBE_TIMEOUT_S) as client:
        while pending:
            for backend in list(pending):
                cause = backend.exit_cause()
                if cause is not None:
                    raise TesselError(f"replica {backend.index} did not start: {cause}")
                if _ready(client, backend):
                    pending.remove(backend)
            if pending and time.monotonic() > deadline:
                names = ", ".join(f"replica {b.index} ({log_tail(b.log_path)})" for b in pending)
                raise TesselError(f"not ready within {timeout_s:g} s: {names}")
            if pending:
                time.sleep(POLL_S)


def _ready(client: httpx.Client, backend: Backend) -> bool:
    try:
        if client.get(f"{backend.url}/health").status_code != 200:
            return False
        models = client.get(f"{backend.url}/v1/models")
    except httpx.TransportError:
        return False  # not listening yet
    if models.status_code != 200:
        return False
    backend.max_model_len = int(models.json()["data"][0]["max_model_len"])
    return True


def stop_backends(backends: list[Backend]) -> None:
    """Stop every backend process (each stops its own stages first); idempotent."""
    terminate([backend.proc for backend in backends])


__all__ = [
    "Backend",
    "ReplicaSpec",
    "ServerProcess",
    "describe_exit",
    "local_backends",
    "start_backends",
    "stop_backends",
]
