"""The pipeline server's watcher: measured stage step times and workload beside the plan's, and
`--remap auto`'s decisions.

Every `interval_s` a daemon thread samples the serving pipeline (whichever engine the server drives
now): stage 0's own counters (`StageRunner.stats`) and every other stage's heartbeat (its
`StageProgress` carries its micro-batches and busy seconds, compute + any emulated slowdown). The
server's outputs give the requests (arrival time and prompt tokens at the first token, output tokens
at the finish). A `RemapWindow` turns them into per-stage seconds per micro-batch and the workload
over the last `window_s` seconds (`tessel.plan.remap.remap_decision`); `/metrics` shows them beside the
plan's predictions. It never reads an emulated speed schedule: a slowed stage shows in its times.

With `--remap auto` the same thread runs `RemapDecider.evaluate` on each window: every decision is
counted in `/metrics` by outcome, those that re-planned are logged with their numbers, and a remap
taken writes the new plan next to the run and asks the server for it (`AsyncEngine.remap`). While
a remap is under way nothing is decided; once it is in service the decider holds later windows
against the new plan (and a failed one waits out the cooldown). A pipeline rebuilt after a lost
stage is followed the same way: its plan is the one held. Over Ray the decider's cluster is the Ray
cluster probed at start, and a machine that joins it is priced (`machine_joins`).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessel.pipeline.flow import is_flow
from tessel.pipeline.supervision.heartbeat import read_beat
from tessel.plan.files.cluster import load_cluster
from tessel.plan.remap.remap_decision import (
    OUTCOMES,
    RemapDecider,
    RemapDecision,
    RemapSettings,
    RemapWindow,
    StageCounters,
    WindowStats,
    plan_workload,
    predicted_step_s,
)

REMAP_MODES = ("off", "auto")
QUIET_OUTCOMES = ("insufficient", "steady")  # counted, not logged
HISTORY = 1000  # decisions kept for inspection (RemapWatch.history)


@dataclass(frozen=True, slots=True)
class StageStep:
    """One stage's step time as `/metrics` shows it."""

    stage: int
    device: str
    measured_s: float | None  # mean busy seconds per micro-batch over the window (None: none ran)
    predicted_s: float  # the plan's


class RemapWatch:
    def __init__(
        self,
        async_engine: Any,
        settings: RemapSettings,
        mode: str = "off",
        echo: Callable[[str], None] = print,
        plan_dir: Path | None = None,
    ) -> None:
        if mode not in REMAP_MODES:
            raise ValueError(f"mode must be one of {REMAP_MODES}, got {mode!r}")
        self.async_engine, self.settings, self.mode, self.echo = async_engine, settings, mode, echo
        self.window = RemapWindow(settings.window_s)
        self.decisions: Counter[str] = Counter({outcome: 0 for outcome in OUTCOMES})
        self.history: deque[RemapDecision] = deque(maxlen=HISTORY)  # the latest decisions, all outcomes
        self.last_stats: WindowStats | None = None
        self._plan_dir = plan_dir
        self._lock = threading.Lock()  # the window: the engine thread adds requests, this one samples
        self._stop = threading.Event()
        self._executor = async_engine.engine.executor
        self._remap_future = None
        self._pending: RemapDecision | None = None
        self.decider = None
        self.joins = None  # over Ray: machines joining the cluster (`machine_joins`)
        if mode == "auto":
            plan = served_plan(self._executor)
            options = getattr(self._executor, "options", None)
            if options is not None and options.executor == "ray":
                from tessel.pipeline.supervision.machine_joins import MachineJoins, serving_cluster

                cluster = serving_cluster(options.ray_address, plan)
                self.joins = MachineJoins(options.ray_address, cluster)
            else:
                cluster = load_cluster(plan.cluster.source or plan.cluster.name)
            self.decider = RemapDecider(plan, cluster, settings)
            if self.joins is not None:  # stage 0 stays on this machine: the server runs it
                self.decider.first_node = plan.stages[0].device.split("/", 1)[0]
        previous = async_engine.on_outputs

        def observe(outputs: list[Any], now_s: float) -> None:
            if previous is not None:
                previous(outputs, now_s)
            self.observe_outputs(outputs, now_s)

        async_engine.on_outputs = observe
        self._seen: set[str] = set()  # requests whose first token was seen (engine thread only)
        self._thread = threading.Thread(target=self._run, name="tessel-remap-watch", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> RemapWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    # ---- inputs ----------------------------------------------------------------------------------
    def observe_outputs(self, outputs: list[Any], now_s: float) -> None:
        """Count requests from a step's outputs (engine thread): arrival at the first token, output
        length at the finish."""
        with self._lock:
            for out in outputs:
                rid = out.request_id
                if rid not in self._seen and out.new_token_ids:
                    self._seen.add(rid)
                    self.window.observe_arrival(out.metrics.arrival_time, out.num_prompt_tokens)
                if out.finished:
                    self._seen.discard(rid)
                    self.window.observe_finish(now_s, out.num_output_tokens)

    def sample(self, executor: Any) -> list[StageCounters] | None:
        """Each stage's cumulative counters now (None while a stage has not beaten yet)."""
        if executor.stage is None or executor.stages is None:
            return None  # not started yet
        stats = executor.stage.stats
        counters = [StageCounters(stats.batches, stats.compute_s + stats.emulation_sleep_s)]
        for rank in range(1, len(executor.plan.stages)):
            beat = read_beat(executor.stages.run_dir, rank)
            if beat is None:
                return None
            counters.append(StageCounters(beat.progress.batches, beat.progress.busy_s))
        return counters

    # ---- what /metrics reads ---------------------------------------------------------------------
    def stage_steps(self) -> list[StageStep]:
        if is_flow(self._executor.plan):
            return []  # a flow plan's placements have no per-stage prediction to set beside them yet
        plan, stats = served_plan(self._executor), self.last_stats
        predicted = predicted_step_s(plan)
        measured = stats.step_s if stats is not None and len(stats.step_s) == len(predicted) else None
        return [
            StageStep(k, stage.device, None if measured is None else measured[k], predicted[k])
            for k, stage in enumerate(plan.stages)
        ]

    def workload(self) -> dict[str, tuple[float | None, float | None]]:
        """quantity -> (measured over the window, the plan's)."""
        stats = self.last_stats
        planned = plan_workload(served_plan(self._executor))
        return {
            "arrival_rate_per_s": (stats and stats.arrival_rate_per_s, planned.arrival_rate_per_s),
            "mean_prompt_tokens": (stats and stats.mean_prompt_tokens, planned.prompt_tokens.mean_tokens),
            "mean_output_tokens": (stats and stats.mean_output_tokens, planned.output_tokens.mean_tokens),
        }

    # ---- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.settings.interval_s):
            try:
                self.tick(time.time())
            except Exception as error:  # noqa: BLE001 - the watcher must never take the server down
                self.echo(f"tessel: remap watch: {type(error).__name__}: {error}")

    def tick(self, now_s: float) -> RemapDecision | None:
        executor = self.async_engine.engine.executor
        if executor is not self._executor:  # a remap or a rebuild: its stages count afresh
            self._follow(executor, now_s)
        counters = self.sample(executor)
        with self._lock:
            if counters is not None:
                self.window.observe_stages(now_s, counters)
            stats = self.window.stats(now_s)
        self.last_stats = stats
        if self.decider is None or self._remap_future is not None:
            return None
        joined = self.joins.joined(now_s) if self.joins is not None else []
        if joined:
            self.echo(f"tessel: {', '.join(joined)} joined the Ray cluster; probing it")
            self.decider.cluster = self.joins.grown_cluster()
            decision = self.decider.evaluate_joined(now_s, joined)
        else:
            decision = self.decider.evaluate(now_s, stats)
        self.decisions[decision.outcome] += 1
        self.history.append(decision)
        if decision.outcome not in QUIET_OUTCOMES:
            self.echo(f"tessel: {decision.describe()}")
        if decision.taken:
            self._ask(decision, now_s)
        return decision

    def _follow(self, executor: Any, now_s: float) -> None:
        self._executor = executor
        with self._lock:
            self.window.reset()
        if self.decider is not None and self._pending is None:
            self.decider.plan = served_plan(executor)  # rebuilt on survivors: hold its plan

    def _ask(self, decision: RemapDecision, now_s: float) -> None:
        directory = self._plan_dir or Path(tempfile.mkdtemp(prefix="tessel-remap-"))
        path = directory / f"remap-{self.decisions['remap']}.json"
        decision.new_plan.write(path)
        self._pending = decision
        self._remap_future = future = self.async_engine.remap(path, decision.reason)
        future.add_done_callback(lambda f: self._remapped(f, decision))

    def _remapped(self, future, decision: RemapDecision) -> None:
        now = time.time()
        error = future.exception()
        report = None if error is not None else future.result()
        if report is not None and report.ok:
            self.decider.adopt(decision, now)
            gap = "-" if report.max_gap_s is None else f"{report.max_gap_s:.3f} s"
            self.echo(
                f"tessel: remapped ({report.moved} requests moved, load {report.load_s:.2f} s, switch "
                f"{report.switch_s:.3f} s, longest gap between two tokens {gap})"
            )
        else:
            self.decider.last_remap_s = now  # wait out the cooldown before trying again
            why = error if error is not None else report.error
            self.echo(f"tessel: remap failed ({why}); the old split serves")
        with self._lock:
            self.window.reset()
        self._pending, self._remap_future = None, None


def served_plan(executor: Any):
    """The plan file of the pipeline `executor` runs: its plan's, with one replica's stages when it
    serves one replica of a replica plan (`--replica K`)."""
    run_plan = executor.plan
    plan = run_plan.plan_file
    replica = getattr(run_plan, "replica", None)
    if replica is None or not plan.replicas:
        return plan
    return plan.model_copy(update={"stages": list(plan.replicas[replica].stages), "replicas": []})


def start_remap_watch(
    async_engine: Any, settings: RemapSettings, mode: str, echo: Callable[[str], None] = print
) -> RemapWatch:
    return RemapWatch(async_engine, settings, mode, echo).start()
