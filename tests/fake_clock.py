"""A fake clock for budget tests: it moves only when a timed run ends, each run taking `run_s` of it, so a
test counts runs against a budget instead of reading wall time (no sleeps, no timing asserts)."""

from __future__ import annotations

from collections.abc import Callable


class FakeTime:
    def __init__(self, run_s: float) -> None:
        self.now_s, self.run_s, self.runs = 0.0, run_s, 0

    def now(self) -> float:
        """The deadline's clock."""
        return self.now_s

    def timer(self, fn: Callable[[], object]) -> float:
        """A profiler `Clock`: runs `fn`, moves the time on by `run_s` and reports that."""
        fn()
        self.now_s += self.run_s
        self.runs += 1
        return self.run_s
