"""Progress of a long step on stderr: a rich bar on a terminal, plain lines otherwise.

A rich bar draws nothing when stderr is a file or a pipe (CI logs, `2> log`), so there the same
callback prints one line per step when it starts, at every tenth of it and when it ends. stdout
keeps only the command's result. The callback is the quant toolkit's `progress(label, done, total)`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tessel.quant.progress import StepProgress

LINE_STEPS = 10  # lines per step when stderr is not a terminal


@contextmanager
def step_progress(*, terminal: bool | None = None) -> Iterator[StepProgress]:
    """A `progress(label, done, total)` callback for the body of the `with`."""
    if terminal is None:
        terminal = sys.stderr.isatty()
    if terminal:
        with _bar() as callback:
            yield callback
        return
    yield _LineProgress()


@contextmanager
def _bar() -> Iterator[StepProgress]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    tasks: dict[str, int] = {}
    columns = (TextColumn("{task.description:>12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True, highlight=False), transient=True) as bar:

        def callback(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done, total=total)

        yield callback


class _LineProgress:
    """Lines like `weights 30/210 (12 s)` on stderr, at most LINE_STEPS + 1 per step."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.printed: dict[str, int] = {}  # label -> the last tenth printed

    def __call__(self, label: str, done: int, total: int) -> None:
        tenth = LINE_STEPS if total <= 0 else min(LINE_STEPS, done * LINE_STEPS // total)
        if label in self.printed and tenth <= self.printed[label]:
            return
        self.printed[label] = tenth if label in self.printed or done else -1
        elapsed = time.monotonic() - self.start
        print(f"{label} {done}/{total} ({elapsed:.0f} s)", file=sys.stderr, flush=True)
