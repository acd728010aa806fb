"""Timing a function: one clock for every profiler (`make_clock`: wall, CPU, CUDA events, or wall
between CUDA synchronizes) and interleaved timed rounds (`time_runs`: every function once per round,
so a change of load on a shared machine hits them alike)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from tessel.deadline import Deadline
from tessel.errors import TesselError

MAX_RUNS = 200  # timed runs of one point at most


Clock = Callable[[Callable[[], object]], float]
CLOCKS = ("wall", "cpu", "cuda", "cuda-wall")


def make_clock(kind: str) -> Clock:
    """A function that runs `fn` once and returns its seconds: "wall" (`time.perf_counter`), "cpu"
    (this process's CPU time), "cuda" (CUDA events around it after a synchronize: the GPU time of the
    work it queued) or "cuda-wall" (wall time from a synchronize to a synchronize after it)."""
    if kind not in CLOCKS:
        raise TesselError(f"clock must be one of {', '.join(CLOCKS)}, got {kind!r}")
    if kind.startswith("cuda"):
        import torch

        if kind == "cuda-wall":

            def run_synchronized(fn: Callable[[], object]) -> float:
                torch.cuda.synchronize()
                begin = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                return time.perf_counter() - begin

            return run_synchronized

        def run_cuda(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3

        return run_cuda

    read = time.process_time if kind == "cpu" else time.perf_counter

    def run_host(fn: Callable[[], object]) -> float:
        begin = read()
        fn()
        return read() - begin

    return run_host


def time_runs(
    fns: Sequence[Callable[[], object]],
    clock: Clock,
    *,
    warmup: int = 1,
    repeats: int = 5,
    min_total_s: float = 0.0,
    max_runs: int = MAX_RUNS,
    deadline: Deadline | None = None,
) -> list[list[float]]:
    """Seconds of every timed run of each of `fns`: `warmup` untimed rounds, then rounds of one timed
    run of each fn in turn (so a load change on a shared machine hits them alike): at least `repeats`
    rounds, and more while the first fn's runs add up to less than `min_total_s` (at most `max_runs`).
    Once `deadline` has passed no round starts: one timed round at least, the warm-up only in time."""
    for _ in range(warmup):
        if deadline is not None and deadline.passed():
            break
        for fn in fns:
            fn()
    runs: list[list[float]] = [[] for _ in fns]
    while runs and (len(runs[0]) < repeats or (sum(runs[0]) < min_total_s and len(runs[0]) < max_runs)):
        for fn, times in zip(fns, runs, strict=True):
            times.append(clock(fn))
        if deadline is not None and deadline.passed():
            break
    return runs
