"""The one exception type for user errors.

A `TesselError` carries a message that says what is wrong and what to do. The CLI prints it
without a traceback and exits with `exit_code` (2 unless a subclass says otherwise).
"""

from __future__ import annotations


class TesselError(Exception):
    """A user error: bad file, unknown GPU, model too big for the cluster, request too long."""

    exit_code: int = 2

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
