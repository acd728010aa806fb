"""The one timer (`tessel.profiling.layer.time_runs`, `make_clock`) the profiler and the benchmarks
share: warm-up rounds, interleaved timed rounds, more runs for cheap calls, the deadline that stops
them, the clocks."""

from __future__ import annotations

import math
import random

import pytest

from fake_clock import FakeTime
from tessel.errors import TesselError
from tessel.profiling.timing import make_clock, time_runs


def test_warm_up_then_interleaved_rounds() -> None:
    order: list[str] = []
    fns = [lambda: order.append("a"), lambda: order.append("b")]

    def clock(fn) -> float:
        fn()
        order.append("timed")
        return 1.0

    runs = time_runs(fns, clock, warmup=2, repeats=3)
    assert order[:4] == ["a", "b", "a", "b"]  # warm-up, untimed
    assert order[4:] == ["a", "timed", "b", "timed"] * 3
    assert runs == [[1.0] * 3, [1.0] * 3]


def test_cheap_calls_get_more_runs_up_to_the_cap() -> None:
    def clock(fn) -> float:
        fn()
        return 0.125  # exact in binary: the sums below are too

    (runs,) = time_runs([lambda: None], clock, warmup=0, repeats=2, min_total_s=1.0)
    assert len(runs) == 8  # until the runs add up to min_total_s
    (capped,) = time_runs([lambda: None], clock, warmup=0, repeats=2, min_total_s=10.0, max_runs=5)
    assert len(capped) == 5


def test_host_clocks_time_the_call_and_unknown_ones_are_refused() -> None:
    calls = []
    for kind in ("wall", "cpu"):
        seconds = make_clock(kind)(lambda: calls.append(sum(range(10_000))))
        assert seconds >= 0.0
    assert len(calls) == 2
    with pytest.raises(TesselError, match="clock must be one of"):
        make_clock("sundial")


def test_timed_rounds_stop_at_the_deadline_with_what_they_have() -> None:
    """However many repeats are asked for, rounds stop once the deadline has passed (issue 42): a round
    in progress ends, and at least one is always timed."""
    from tessel.deadline import Deadline

    rng = random.Random()
    for _ in range(50):
        fake = FakeTime(rng.randint(1, 64) / 64)  # sixty-fourths: every sum below is exact
        fns = [lambda: None] * rng.randint(1, 6)
        budget_s = (rng.randint(0, 1280) + 0.5) / 64  # never a whole number of runs
        repeats = rng.randint(1, 200)
        deadline = Deadline.after(budget_s, fake.now)
        runs = time_runs(fns, fake.timer, warmup=2, repeats=repeats, deadline=deadline)
        round_s = len(fns) * fake.run_s
        rounds = min(repeats, math.ceil(budget_s / round_s))
        assert [len(times) for times in runs] == [rounds] * len(fns), (budget_s, round_s, repeats)
        assert fake.runs == rounds * len(fns)
