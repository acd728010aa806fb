"""The remap decision in the simulator: the server's decision function, at its cadence.

A simulated run (with the plan's emulated speed schedules, `SimConfig.slowdowns`) is read back as
the pipeline server's watcher reads a live one (`tessel.pipeline.supervision.remap_watch`): every `interval_s`
each stage's cumulative micro-batches and busy seconds (its compute boxes that ended by then), the
requests that arrived (prompt tokens) and finished (output tokens) go into a `RemapWindow`, and
`RemapDecider.evaluate` decides. The replay stops at the first remap the decision takes: the
simulated pipeline keeps its split, so what follows would no longer be what the server sees.

Only the ticks near a stage's work are replayed: a tick whose window saw no micro-batch end would
decide "insufficient" (every stage ran 0 of `min_batches`) and change nothing, so the ticks more than
a window away from every micro-batch end are counted (`SimulatedRemap.skipped`), not evaluated. The
decisions replayed are exactly the server's; their number is bounded by the run's micro-batches, not
by its simulated seconds, and refused above `MAX_REMAP_EVALUATIONS`.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tessel.errors import TesselError
from tessel.plan.files.cluster import Cluster, load_cluster
from tessel.plan.files.plan_file import PlanFile
from tessel.plan.remap.remap_decision import (
    RemapDecider,
    RemapDecision,
    RemapSettings,
    RemapWindow,
    StageCounters,
)
from tessel.sim.simulator import SimResult

# Decisions one replay evaluates at most: a day of busy stages at the default 2 s interval is 43,200;
# each may re-plan (tens of ms), so more would keep a simulation busy for hours.
MAX_REMAP_EVALUATIONS = 100_000
TICK_MARGIN = 2  # ticks replayed beyond a window around each micro-batch end: float rounding of tick times


@dataclass(frozen=True, slots=True)
class SimulatedRemap:
    decisions: tuple[RemapDecision, ...]  # every evaluation replayed, up to the first remap taken
    skipped: int = 0  # evaluations over idle stretches, each "insufficient": counted, not replayed

    @property
    def taken(self) -> RemapDecision | None:
        return next((d for d in self.decisions if d.taken), None)

    @property
    def evaluations(self) -> int:
        """The server's evaluations over the run (up to the remap taken)."""
        return len(self.decisions) + self.skipped

    def summary(self) -> str:
        taken = self.taken
        if taken is None:
            last = self.decisions[-1] if self.decisions else None
            why = f" (last: {last.outcome}, {last.reason})" if last is not None else ""
            return f"no remap in {self.evaluations} evaluations{why}"
        return taken.describe()

    def to_json(self) -> dict:
        taken = self.taken
        return {
            "remap": taken is not None,
            "time_s": None if taken is None else taken.time_s,
            "new_layers": None if taken is None else [list(r) for r in taken.new_layers],
            "decisions": [d.to_json() for d in self.decisions if d.outcome != "insufficient"],
            "evaluations": self.evaluations,
            "skipped_idle": self.skipped,
        }


def simulated_remap(
    plan: PlanFile,
    result: SimResult,
    requests: Sequence,
    settings: RemapSettings,
    cluster: Cluster | None = None,
    solver: str = "dp",
) -> SimulatedRemap:
    """The decisions the server's remap watcher would take on `result` (a run of `plan`'s main
    pipeline serving `requests`); `cluster`: the plan's own (its `cluster.source`) when None."""
    cluster = cluster or load_cluster(plan.cluster.source)
    decider = RemapDecider(plan, cluster, settings, solver=solver)
    window = RemapWindow(settings.window_s)
    ends, busy = _stage_boxes(result)
    arrivals = sorted((r.arrival_s, r.prompt_tokens) for r in requests)
    finishes = sorted((rec.finish_s, rec.request.output_tokens) for rec in result.records)
    end_s = max([rec.finish_s for rec in result.records], default=0.0)
    ticks = _ticks_near_work(sorted(itertools.chain.from_iterable(ends)), settings, end_s)
    decisions: list[RemapDecision] = []
    a = f = 0
    for tick in ticks:
        now = tick * settings.interval_s
        counters = []
        for stage_ends, stage_busy in zip(ends, busy, strict=True):
            n = bisect.bisect_right(stage_ends, now)
            counters.append(StageCounters(n, stage_busy[n]))
        window.observe_stages(now, counters)
        while a < len(arrivals) and arrivals[a][0] <= now:
            window.observe_arrival(*arrivals[a])
            a += 1
        while f < len(finishes) and finishes[f][0] <= now:
            window.observe_finish(*finishes[f])
            f += 1
        decision = decider.evaluate(now, window.stats(now))
        decisions.append(decision)
        if decision.taken:
            last_tick = tick
            break
    else:
        last_tick = _last_tick(end_s, settings.interval_s)
    return SimulatedRemap(tuple(decisions), skipped=max(last_tick - len(decisions), 0))


def _last_tick(end_s: float, interval_s: float) -> int:
    """The last tick (1, 2, ...) at or before `end_s`, as `tick * interval_s` rounds."""
    tick = int(end_s // interval_s)
    if (tick + 1) * interval_s <= end_s:
        tick += 1
    if tick > 0 and tick * interval_s > end_s:
        tick -= 1
    return tick


def _ticks_near_work(box_ends: list[float], settings: RemapSettings, end_s: float) -> list[int]:
    """The ticks within a window (and TICK_MARGIN ticks) of a micro-batch end, ascending: the others'
    windows saw no micro-batch end, so they decide "insufficient". Refused past MAX_REMAP_EVALUATIONS."""
    interval, window = settings.interval_s, settings.window_s
    last = _last_tick(end_s, interval)
    ranges: list[list[int]] = []
    for end in box_ends:
        low = max(math.ceil((end - window) / interval) - TICK_MARGIN, 1)
        high = min(math.floor((end + window) / interval) + TICK_MARGIN, last)
        if low > high:
            continue
        if ranges and low <= ranges[-1][1] + 1:
            ranges[-1][1] = max(ranges[-1][1], high)
        else:
            ranges.append([low, high])
    count = sum(high - low + 1 for low, high in ranges)
    if count > MAX_REMAP_EVALUATIONS:
        raise TesselError(
            f"--remap-interval-s {interval:g} over the {count * interval:,.0f} s this run's stages work "
            f"(within --remap-window-s {window:g} of a micro-batch) is {count:,} remap decisions, more than "
            f"the {MAX_REMAP_EVALUATIONS:,} a simulation replays; raise --remap-interval-s or shorten "
            "--remap-window-s"
        )
    return [tick for low, high in ranges for tick in range(low, high + 1)]


def _stage_boxes(result: SimResult) -> tuple[list[list[float]], list[list[float]]]:
    """Per stage, the end times of its compute boxes (ascending) and the busy seconds summed up to
    each (busy[k][n]: the first n boxes')."""
    boxes: list[list[tuple[float, float]]] = [[] for _ in range(result.n_stages)]
    for box in result.intervals:
        if box.kind == "compute":
            boxes[box.stage].append((box.end_s, box.end_s - box.start_s))
    boxes = [sorted(stage) for stage in boxes]
    ends = [[end for end, _ in stage] for stage in boxes]
    busy = [list(itertools.accumulate((d for _, d in stage), initial=0.0)) for stage in boxes]
    return ends, busy
