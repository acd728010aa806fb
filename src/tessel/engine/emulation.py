"""Slow-device emulation: on one CPU, a slower device or a slower host link, by sleeping.

tessel runs uneven plans on a machine that has only CPUs by making parts of it slower, never by
modelling them: what a plan's cluster file says under `emulate` (`tessel.plan.files.cluster`; the plan
file carries it per stage) the runtime turns into sleeps here, and the simulator into the same
slowdowns. Every figure measured under emulation is the emulated device's, never a GPU's.

- `SlowDevice`: a stage at speed s < 1 sleeps (1/s - 1) x its measured compute after each
  micro-batch. With a speed schedule, s is the schedule's speed at the seconds since the pipeline's
  first micro-batch (`tessel.plan.files.plan_parts.emulated_speed_at`); stage 0 of a plan with a
  schedule publishes when that was in `EMULATE_EPOCH_ENV` (wall-clock seconds), which stage processes
  spawned later (a remapped pipeline) inherit, so a device's schedule runs on through a remap.
- `hold_link`: a copy over an emulated host link (KV blocks swapped to the host pool, streamed
  weights) that finished faster than bytes / bandwidth sleeps for the difference.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from tessel.plan.files.plan_parts import emulated_speed_at
from tessel.units import GBPS

EMULATE_EPOCH_ENV = "TESSEL_EMULATE_EPOCH"  # wall-clock seconds the emulated schedules count from


def hold_link(num_bytes: int, elapsed_s: float, gbps: float | None) -> float:
    """Sleep so that a copy of `num_bytes` that took `elapsed_s` lasts `num_bytes / gbps`; -> the
    seconds slept (0 without emulation, or when the copy was already slower)."""
    if gbps is None:
        return 0.0
    wait_s = num_bytes / (gbps * GBPS) - elapsed_s
    if wait_s <= 0:
        return 0.0
    time.sleep(wait_s)
    return wait_s


@dataclass(slots=True)
class SlowDevice:
    """A stage's emulated speed: constant (`speed`) or changing over time (`schedule`: (seconds since
    the first micro-batch, speed) changes)."""

    speed: float = 1.0
    schedule: tuple[tuple[float, float], ...] = ()
    publish_epoch: bool = False  # stage 0 of a plan with a schedule: set EMULATE_EPOCH_ENV
    _origin_s: float | None = None  # perf_counter at the pipeline's first micro-batch

    def pause(self, started_s: float, compute_s: float) -> float:
        """After a micro-batch that began at `started_s` (perf_counter) and computed `compute_s`:
        sleep as the device's speed asks; -> the seconds slept."""
        if self._origin_s is None:
            self._origin_s = self._origin(started_s)
        now = time.perf_counter()
        speed = emulated_speed_at(self.speed, self.schedule, now - self._origin_s)
        if speed >= 1.0:
            return 0.0
        pause_s = (1.0 / speed - 1.0) * max(compute_s, 0.0)
        time.sleep(pause_s)
        return pause_s

    @property
    def origin_s(self) -> float | None:
        return self._origin_s

    def _origin(self, started_s: float) -> float:
        """perf_counter time the schedule counts from: the published epoch, else `started_s`."""
        epoch = os.environ.get(EMULATE_EPOCH_ENV)
        offset_s = time.time() - time.perf_counter()  # wall clock minus perf_counter
        if epoch:
            try:
                return float(epoch) - offset_s
            except ValueError:
                pass
        if self.publish_epoch:
            os.environ[EMULATE_EPOCH_ENV] = repr(started_s + offset_s)
        return started_s
