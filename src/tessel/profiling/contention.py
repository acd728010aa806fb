"""How much a decoder layer slows when another stage computes beside it on the same CPU host.

CPU stages of one host share more than its cores: their weights stream through the same memory
controllers and last-level cache. A decode step of a small batch reads every weight once per token,
so two stages decoding at once each run slower than a profile timed alone says; beside a process
that only keeps a core busy they do not (`benchmarks/contention.py` measures both: docs/results.md,
"Stages of one CPU host share its memory"). Processor sharing (`tessel.sim.simulator.CoreSharing`)
prices the cores; this prices the memory.

`measure_contention` times a decode point of the engine's layer (the profile's `_Layer`, its copies
streaming from memory) in rounds of `HALF_ROUND_S` of runs each way: first with `co_runners`
processes (running the same point on the other cores) held between their runs, then with them
running; the ratio of the medians is the slowdown with that many co-runners. Alternating within each
round keeps the machine's drift (a shared host's speed moves by tens of percent within minutes) out of
the ratio. `tessel profile` stores it as the component `contention:decode` (`ComponentFit`, unit
"co-runners", t(m) = 1 + c1 * m: the slowdown with m stages computing beside it, extrapolated
linearly from one co-runner), which the simulator applies to the decode batches of CPU stages of one
host while several compute at once. Prefill passes are compute-bound and are
not priced for it (the simulator reads a `contention:prefill` component if a profile has one).
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable
from typing import Any

from tessel.cost.profile import ComponentFit
from tessel.deadline import Deadline
from tessel.errors import TesselError

CONTENTION_DECODE = "contention:decode"
DECODE_POINT = (4, 256)  # 4 sequences of 256 cached tokens each: a pipeline's micro-batch
MAX_TOKENS = 512  # the layer's room for DECODE_POINT
MIN_ROUNDS = 10
HALF_ROUND_S = 0.25  # runs each way in a round
START_TIMEOUT_S = 120.0  # a co-runner builds its layer copies first


def decode_inputs(layer):  # noqa: ANN001, ANN202
    batch, context = DECODE_POINT
    return layer.decode_inputs(batch, context)


def co_run(make_layer: Callable[[], Any], threads: int, events: dict) -> None:
    """A co-runner: a layer of its own (`make_layer()`), its decode point run while `go` is set
    (`active` set after each run), until `stop`."""
    import torch

    torch.set_num_threads(threads)
    layer = make_layer()
    inputs = decode_inputs(layer)
    go, active, stop = events["go"], events["active"], events["stop"]
    with torch.inference_mode():
        layer.forward(*inputs)
        events["ready"].set()
        while not stop.is_set():
            if go.is_set():
                layer.forward(*inputs)
                active.set()
            else:
                active.clear()
                go.wait(0.05)


def measure_contention(
    make_layer: Callable[[], Any],
    threads: int,
    clock,  # noqa: ANN001 (tessel.profiling.timing.Clock: seconds of one call)
    co_runners: int = 1,
    deadline: Deadline | None = None,
) -> dict[str, ComponentFit]:
    """The decode slowdown with `co_runners` processes beside this one (module docstring), as the
    profile component `contention:decode`. `make_layer`: builds the profile's layer (`_Layer`) with
    room for `DECODE_POINT`; picklable, since each co-runner builds its own."""
    import torch

    layer = make_layer()
    context = multiprocessing.get_context("spawn")
    runners = []
    for _ in range(co_runners):
        events = {name: context.Event() for name in ("go", "active", "stop", "ready")}
        proc = context.Process(target=co_run, args=(make_layer, threads, events), daemon=True)
        proc.start()
        runners.append((proc, events))
    fits = {}
    try:
        wait_started(runners)
        with torch.inference_mode():
            alone, beside = alone_and_beside(layer, decode_inputs(layer), runners, clock, deadline)
        slope = max(beside / alone - 1.0, 0.0) / co_runners
        fits[CONTENTION_DECODE] = ComponentFit(1.0, slope, "co-runners", 0.0, 2)
    finally:
        for _, events in runners:
            events["stop"].set()
            events["go"].set()
        for proc, _ in runners:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return fits


def wait_started(runners) -> None:  # noqa: ANN001
    """Until every co-runner has built its layer; one that died or took `START_TIMEOUT_S` raises."""
    until = time.monotonic() + START_TIMEOUT_S
    for proc, events in runners:
        while not events["ready"].wait(0.1):
            if not proc.is_alive():
                code = proc.exitcode
                raise TesselError(f"a contention co-runner exited with code {code} before it started")
            if time.monotonic() > until:
                raise TesselError(f"a contention co-runner did not start within {START_TIMEOUT_S:g} s")


def alone_and_beside(
    layer,  # noqa: ANN001
    inputs,  # noqa: ANN001
    runners,  # noqa: ANN001
    clock,  # noqa: ANN001
    deadline: Deadline | None,
    min_rounds: int = MIN_ROUNDS,
    half_round_s: float = HALF_ROUND_S,
) -> tuple[float, float]:
    """(median seconds of a run alone, of one beside the co-runners) over rounds of `half_round_s`
    of runs each way: `min_rounds` at least, more while `deadline` allows (3x at most)."""
    alone, beside = [], []
    layer.forward(*inputs)  # warm
    rounds = 0
    while rounds < min_rounds or (deadline is not None and not deadline.passed() and rounds < 3 * min_rounds):
        for _, events in runners:
            events["go"].clear()
        while any(events["active"].is_set() for _, events in runners):
            time.sleep(0.001)
        alone += _runs(layer, inputs, clock, half_round_s)
        for _, events in runners:
            events["go"].set()
        for _, events in runners:
            if not events["active"].wait(START_TIMEOUT_S):
                raise TesselError(f"a contention co-runner ran nothing for {START_TIMEOUT_S:g} s")
        beside += _runs(layer, inputs, clock, half_round_s)
        rounds += 1
    for _, events in runners:
        events["go"].clear()
    return statistics.median(alone), statistics.median(beside)


def _runs(layer, inputs, clock, seconds: float) -> list[float]:  # noqa: ANN001
    """Runs of the point until `seconds` of wall time have passed (one at least): their seconds."""
    times = []
    until = time.perf_counter() + seconds
    while not times or time.perf_counter() < until:
        times.append(clock(lambda: layer.forward(*inputs)))
    return times
