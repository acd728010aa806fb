"""The remap decision in the simulator: the server's decision function, at its cadence.

A simulated run (with the plan's emulated speed schedules, `SimConfig.slowdowns`) is read back as
the pipeline server's watcher reads a live one (`tessel.pipeline.remap_watch`): every `interval_s`
each stage's cumulative micro-batches and busy seconds (its compute boxes that ended by then), the
requests that arrived (prompt tokens) and finished (output tokens) go into a `RemapWindow`, and
`RemapDecider.evaluate` decides. The replay stops at the first remap the decision takes: the
simulated pipeline keeps its split, so what follows would no longer be what the server sees.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class SimulatedRemap:
    decisions: tuple[RemapDecision, ...]  # every evaluation, up to the first remap taken

    @property
    def taken(self) -> RemapDecision | None:
        return next((d for d in self.decisions if d.taken), None)

    def summary(self) -> str:
        taken = self.taken
        if taken is None:
            last = self.decisions[-1] if self.decisions else None
            why = f" (last: {last.outcome}, {last.reason})" if last is not None else ""
            return f"no remap in {len(self.decisions)} evaluations{why}"
        return taken.describe()

    def to_json(self) -> dict:
        taken = self.taken
        return {
            "remap": taken is not None,
            "time_s": None if taken is None else taken.time_s,
            "new_layers": None if taken is None else [list(r) for r in taken.new_layers],
            "decisions": [d.to_json() for d in self.decisions if d.outcome != "insufficient"],
            "evaluations": len(self.decisions),
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
    decisions: list[RemapDecision] = []
    a = f = 0
    for tick in itertools.count(1):
        now = tick * settings.interval_s
        if now > end_s:
            break
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
            break
    return SimulatedRemap(tuple(decisions))


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
