"""CLI hardening helpers: run a command, expect exit code 2 and a message, under a time guard."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from typer.testing import CliRunner

from tessel.cli import app
from tessel.errors import TesselError

BINARY = bytes(range(256)) * 4  # NUL bytes and every other byte
LATIN1 = "name: caf\u00e9\nnodes: []\n".encode("latin-1")  # valid text, not UTF-8


class Timeout(Exception):
    pass


@contextmanager
def time_guard(seconds: float):
    """Fail (instead of hanging) when the body runs longer than `seconds`; main thread only."""

    def expire(signum, frame):  # noqa: ANN001
        raise Timeout(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def user_error(args: list[str], *, guard_s: float = 120.0) -> str:
    """Run `tessel ARGS`; it must fail as a user error (TesselError, or typer's usage error, both exit 2
    under `tessel.cli.main`) with no other exception. Returns the message and what was printed before."""
    with time_guard(guard_s):
        result = CliRunner().invoke(app, [str(a) for a in args])
    if isinstance(result.exception, TesselError):
        assert result.exception.exit_code == 2
        return f"{result.exception}\n{' '.join(result.output.split())}"
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (
        args,
        result.exit_code,
        repr(result.exception),
        result.output[-2000:],
    )
    return " ".join(result.output.split())


def succeeds_or_user_error(args: list, *, guard_s: float = 60.0) -> int:
    """Run `tessel ARGS`: success, or a user error (exit 2 with a message); never another exception."""
    with time_guard(guard_s):
        result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exit_code == 0:
        return 0
    if isinstance(result.exception, TesselError):
        assert result.exception.exit_code == 2 and str(result.exception).strip()
        return 2
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (
        args,
        result.exit_code,
        repr(result.exception),
        result.output[-2000:],
    )
    return 2


def run_tessel_process(
    args: list, *, timeout_s: float, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m tessel.cli ARGS` in a session of its own; past `timeout_s` the whole session (the
    command and any stage process it started) is killed and the test fails, naming the command."""
    command = [sys.executable, "-m", "tessel.cli", *map(str, args)]
    process = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise Timeout(f"tessel {' '.join(map(str, args))} ran more than {timeout_s} s") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
