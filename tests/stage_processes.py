"""Clean-up of the stage processes a fault test stopped or left behind."""

from __future__ import annotations

import os
import signal


def release(pids: list[int]) -> None:
    """SIGCONT then SIGKILL whatever is left of a test's stage processes."""
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break


def alive(pid: int) -> bool:
    """Whether a process with this pid still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
