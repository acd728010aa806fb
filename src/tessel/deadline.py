"""A wall-clock budget that one command's phases share (`tessel profile --budget-s`).

    deadline = Deadline.after(budget_s)
    phases = deadline.phases({"layer": 6.0, "transport": 1.0})
    layer = phases.start("layer")        # 6/7 of the time left now
    ...                                  # timing loops stop once `layer.passed()`, with what they have
    transport = phases.start("transport")  # all of what is left then

A phase gets its weight's share of the time left when it starts, over the weights of it and the
phases after it: what one phase leaves unspent goes to the later ones, and one that overran takes
from them; a phase's reserve (`Phases.reserve`: the least it will take) is kept from the earlier
ones. The clock is injectable (tests pass a fake one); `time.monotonic` by default, which is one
clock for every process of a host. No torch here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Deadline:
    end_s: float  # on `clock`
    clock: Clock = field(default=time.monotonic, compare=False)

    @classmethod
    def after(cls, seconds: float, clock: Clock = time.monotonic) -> Deadline:
        return cls(clock() + seconds, clock)

    def left_s(self) -> float:
        return max(0.0, self.end_s - self.clock())

    def passed(self) -> bool:
        return self.clock() >= self.end_s

    def share(self, fraction: float) -> Deadline:
        """A deadline `fraction` (0..1) of the time left from now: never past this one."""
        now = self.clock()
        return Deadline(now + min(max(fraction, 0.0), 1.0) * max(0.0, self.end_s - now), self.clock)

    def phases(self, weights: dict[str, float]) -> Phases:
        return Phases(self, dict(weights))


@dataclass(slots=True)
class Phases:
    """The phases still to run under one deadline, by weight, in the order they will start; a phase
    may have a reserve (the least it takes, however short its share: one timed round of what its fit
    needs), which the phases before it leave it."""

    deadline: Deadline
    pending: dict[str, float]
    reserved: dict[str, float] = field(default_factory=dict)

    def reserve(self, name: str, seconds: float) -> None:
        self.reserved[name] = seconds

    def start(self, name: str) -> Deadline:
        """Phase `name`'s deadline: its reserve, and its weight over the pending weights of the time
        left now beyond the reserves of all pending phases."""
        total = sum(self.pending.values())
        weight = self.pending.pop(name)
        own = self.reserved.pop(name, 0.0)
        now, left_s = self.deadline.clock(), self.deadline.left_s()
        spare_s = max(0.0, left_s - own - sum(self.reserved.get(later, 0.0) for later in self.pending))
        seconds = own + spare_s * (weight / total if total > 0 else 1.0)
        return Deadline(now + min(seconds, left_s), self.deadline.clock)


def spread_order(n: int) -> list[int]:
    """0..n-1 in an order whose every prefix spreads over the range: both ends, the middle, the
    quarters, ... (a loop stopped early has kept points from the whole of it)."""
    order = [0, n - 1][: min(n, 2)]
    intervals = [(0, n - 1)]
    while intervals:
        halves = []
        for low, high in intervals:
            if high - low > 1:
                middle = (low + high) // 2
                order.append(middle)
                halves += [(low, middle), (middle, high)]
        intervals = halves
    return order
