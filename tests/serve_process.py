"""`tessel serve` as a child process on 127.0.0.1 for tests that drive it as a client would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

START_DEADLINE_S = 180.0  # importing torch and loading a model on two busy cores
POLL_S = 0.05


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    port = free_port()
    command = [sys.executable, "-m", "tessel.cli", "serve", "--model", str(model), "--port", str(port)]
    command += ["--host", "127.0.0.1", "--log-level", "warning", *options]
    url = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
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
