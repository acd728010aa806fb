"""`tessel serve` as a child process on 127.0.0.1 for tests that drive it as a client would."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tessel.ports import port_of, reserve_port
from tessel.server.replica_backends import listen_argv

START_DEADLINE_S = 180.0  # importing torch and loading a model on two busy cores
POLL_S = 0.05


def start_serving(command: list[str], **popen: Any) -> tuple[subprocess.Popen, str]:
    """Start the `tessel serve` `command` on a port bound here and inherited (--listen-fd), so
    nothing takes the port while the server loads its model; (the process, its URL)."""
    with reserve_port("127.0.0.1") as listener:
        argv = [*command, *listen_argv(listener)]
        process = subprocess.Popen(argv, pass_fds=(listener.fileno(),), **popen)
        return process, f"http://127.0.0.1:{port_of(listener)}"


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.TransportError:
        return False


@dataclass(frozen=True)
class Served:
    url: str  # http://127.0.0.1:PORT
    pid: int

    def cpu_s(self) -> float:
        """CPU seconds the server process has used so far (user + system, all threads; Linux)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def serve_process(model: Path, log_path: Path, *options: str) -> Iterator[Served]:
    """Start `tessel serve --model model options...`; yield it once /health answers."""
    command = [sys.executable, "-m", "tessel.cli", "serve", "--model", str(model)]
    command += ["--log-level", "warning", *options]
    with log_path.open("w") as log:
        process, url = start_serving(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + START_DEADLINE_S
            while not _healthy(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"`tessel serve` did not come up:\n{log_path.read_text()}")
                time.sleep(POLL_S)  # a poll interval, not a synchronisation sleep
            yield Served(url, process.pid)
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=60)
