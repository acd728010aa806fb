"""Several pipelines on one event heap whose stages may share a device (a flow plan's paths).

Each path is its own pipeline with its own scheduler and requests (`tessel.sim.simulator`), but a
device computes one micro-batch at a time across every path that runs a stage on it: a stage whose
next batch has arrived while its device computes another path's batch waits in the device's queue,
and the device, once free, takes the waiting stages in the order they began waiting. So a shared
device's time goes to its paths as their batches reach it, not in fixed fractions. Sends use the
sending path's own link (a node's network interface shared by several paths is not modelled).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from tessel.chunk.latency import PipelineLatency
from tessel.sim.requests import Request
from tessel.sim.simulator import PipelineRun, SimConfig, SimResult


@dataclass(frozen=True, slots=True)
class SharedPath:
    pipeline: PipelineLatency
    config: SimConfig
    requests: list[Request]
    devices: tuple[Hashable, ...]  # per stage: the device it computes on (equal keys share one)

    def __post_init__(self) -> None:
        if len(self.devices) != self.pipeline.n_stages:
            raise ValueError(f"{len(self.devices)} devices for {self.pipeline.n_stages} stages")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"a path visits a device twice: {self.devices}")


class _Devices:
    """Which devices compute now, and the (path run, stage) waiting for each, first come first."""

    def __init__(self) -> None:
        self.busy: set[Hashable] = set()
        self.waiting: dict[Hashable, deque[tuple[_PathRun, int]]] = {}

    def acquire(self, run: _PathRun, index: int) -> bool:
        device = run.devices[index]
        if device not in self.busy:
            self.busy.add(device)
            return True
        queue = self.waiting.setdefault(device, deque())
        if (run, index) not in queue:
            queue.append((run, index))
        return False

    def release(self, now: float, device: Hashable) -> None:
        self.busy.discard(device)
        queue = self.waiting.get(device)
        while queue and device not in self.busy:
            run, index = queue.popleft()
            run.try_start(now, index)


class _PathRun(PipelineRun):
    def __init__(self, path: SharedPath, shared: _Devices, heap: list, counter) -> None:
        super().__init__(path.pipeline, path.config, path.requests)
        self.devices = path.devices
        self.shared = shared
        self.events = heap
        self.ticket = counter

    def push(self, time_s: float, kind: int, stage: int, payload: object) -> None:
        heapq.heappush(self.events, (time_s, kind, next(self.ticket), stage, (self, payload)))

    def acquire(self, index: int) -> bool:
        return self.shared.acquire(self, index)

    def release(self, now: float, index: int) -> None:
        self.shared.release(now, self.devices[index])

    def compute_done(self, now: float, index: int, batch) -> None:
        super().compute_done(now, index, batch)
        if index == 0:  # batches formed while the device served another path wait here
            self.try_start(now, 0)


def simulate_shared(paths: Sequence[SharedPath]) -> list[SimResult]:
    """Each path's result, its stages' devices shared with the other paths' (module docstring)."""
    heap: list = []
    shared, counter = _Devices(), itertools.count()
    runs = [_PathRun(path, shared, heap, counter) for path in paths]
    for run in runs:
        run.arrive()
    while heap:
        now = heap[0][0]
        while heap and heap[0][0] == now:
            _, kind, _, stage, (run, payload) = heapq.heappop(heap)
            run.handle(now, kind, stage, payload)
        for run in runs:
            run.dispatch(now)
    return [run.result() for run in runs]
