"""The supervisor behind a served pipeline (`tessel serve --plan`): liveness, rebuilding after a lost
stage, and switching to a new split while serving.

The server drives one engine handle, an `LLMEngine` whose executor is a `ProcessExecutor` with the
other stages as this process's children. The supervisor stands behind it (`engine.supervisor`):
the engine's `step` runs through `Supervisor.step`, so everything that replaces the pipeline happens
on the engine's thread, between two steps, and the requests never leave the engine:

- **Liveness.** A watcher thread per pipeline polls its stage processes and their heartbeats
  (`LocalStages.failure`: a stage that died, fell silent, stopped, or a stuck pipeline). On a failure
  it marks the executor failed, stops every stage process (which also ends a receive stage 0 is
  blocked in) and wakes the engine's thread, whose next step raises the `StageFailedError` naming
  the stage and the cause.
- **Rebuild.** A step that fails with a lost stage (an error whose `recovery` is "rebuild") is
  answered here: the old pipeline is stopped, the plan re-split over the stages left when one is to
  blame (`tessel.plan.remap.survivors`: the planner on the cluster without the lost device, else by
  memory), the new stages spawned, stage 0 loaded and joined, and the unfinished requests moved into
  the new executor (`LLMEngine.replace_executor`: recomputed there, their streams go on without an
  error or a repeated token). Meanwhile `recovering` names the failure, so `/health` answers 503 with
  `Retry-After`, and new requests wait. Each rebuild counts against `max_rebuilds`; past it, or when
  the survivors cannot hold the model (`SurvivorsTooSmallError`), the step raises a `PipelineDown`
  (recovery "none"): the server stays up without an engine, answering 503 with the reason.
- **Live remap.** `remap(plan)` (any thread) -> a future of its `RemapReport`: on the engine thread
  the new split's stage processes are spawned; on a background thread stage 0's layers are loaded
  here and every new stage's awaited, while the old pipeline serves; then, on the engine thread,
  the switch: the old pipeline's micro-batches in flight finished and delivered, the old stages
  stopped, the new group joined and the requests moved in. The future resolves once every moved
  stream has its next token (`max_gap_s`: the longest time between two tokens of a moved stream). A
  new stage that dies while loading leaves the old pipeline untouched (`rolled_back`); a failure
  while joining (after the old one stopped) builds the old split again and moves the requests there.
  Remaps do not count against `max_rebuilds`.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tessel.errors import TesselError
from tessel.pipeline.executor import ProcessExecutor
from tessel.pipeline.flow import is_flow
from tessel.pipeline.options import RunOptions
from tessel.pipeline.run_plan import RunPlan
from tessel.pipeline.spawn import spawn_pipeline

WATCH_INTERVAL_S = 0.5
REBUILD_RETRY_AFTER_S = 5  # Retry-After while the pipeline is rebuilt, before one rebuild was timed

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RemapReport:
    """What a remap (or a rebuild after a lost stage) did, for logs and for whoever asked for it."""

    reason: str
    plan: str  # the plan file of the pipeline asked for
    ok: bool
    error: str | None = None  # why it failed (`ok` False)
    rolled_back: bool = False  # it failed and the old split serves (requests intact)
    load_s: float = 0.0  # spawning the new stages until every stage had loaded its layers
    switch_s: float = 0.0  # the engine thread's pause: old pipeline drained and stopped, new joined
    moved: int = 0  # requests moved into the new pipeline (recomputed there)
    max_gap_s: float | None = None  # the longest time between two tokens of a moved stream


@dataclass(frozen=True, slots=True)
class StageGauge:
    """One stage as `/metrics` shows it (`tessel.server.prometheus`, labels `stage` and `device`)."""

    stage: int
    device: str  # the plan's device name
    up: bool  # its process runs (stage 0 is the server process itself)
    heartbeat_age_s: float | None  # seconds since its last heartbeat (None: stage 0, or no beat yet)


class PipelineDown(TesselError):
    """The pipeline is lost for good (no rebuild left, or none possible): the server answers 503."""

    recovery = "none"


@dataclass(slots=True)
class _Remap:
    """A remap under way: its new executor through spawn -> loading -> loaded, then the switch."""

    options: RunOptions
    report: RemapReport
    done: Future
    state: str = "spawn"  # "spawn" (engine thread) -> "loading" (background) -> "loaded" -> switched
    executor: ProcessExecutor | None = None
    error: BaseException | None = None


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class Supervisor:
    def __init__(self, options: RunOptions, max_rebuilds: int) -> None:
        self.options = options  # what the serving pipeline was built from
        self.max_rebuilds = max_rebuilds
        self.num_rebuilds = 0
        self.recovering: BaseException | None = None  # the failure a rebuild is answering
        self.retry_after_s = REBUILD_RETRY_AFTER_S
        self.last_recovery: RemapReport | None = None  # the last rebuild's figures
        self._remap: _Remap | None = None
        self._lock = threading.Lock()
        self._watching: dict[int, threading.Event] = {}  # id(executor) -> its watcher's stop
        self._last_token_s: dict[str, float] = {}  # when each stream got its last token
        self._gap_watch: dict[str, float] = {}  # streams moved by the last switch, not yet resumed
        self._gap_report: tuple[RemapReport, Future | None] | None = None
        self.engine: Any = None

    # ---- building ---------------------------------------------------------------------------------
    @classmethod
    def serve(cls, options: RunOptions, max_rebuilds: int) -> Any:
        """The engine `tessel serve --plan` drives: the plan's stages spawned, stage 0 loaded here while
        they load theirs, joined, and this supervisor behind it."""
        from tessel.engine.llm_engine import LLM

        supervisor = cls(options, max_rebuilds)
        executor = spawn_pipeline(options, _run_dir())
        try:
            engine = LLM(options.model, executor=executor, **options.engine_kwargs())
        except BaseException:
            executor.shutdown()
            raise
        supervisor.attach(engine)
        return engine

    def attach(self, engine: Any) -> None:
        self.engine = engine
        engine.supervisor = self
        self._watch(engine.executor)

    def close(self) -> None:
        """Stop the serving pipeline (the server stops)."""
        self._unwatch(self.engine.executor)
        self.engine.executor.shutdown()

    # ---- the engine's step ----------------------------------------------------------------------
    def has_work(self) -> bool:
        remap = self._remap
        return remap is not None and remap.state in ("spawn", "loaded")

    def step(self, engine: Any) -> list:
        """The engine's step, with what the supervisor has to do first (a remap's spawn or switch)
        and a lost stage answered by a rebuild."""
        outputs: list = []
        self._advance_remap(engine, outputs)
        try:
            outputs += engine.run_step()
        except Exception as error:  # noqa: BLE001 - only a lost stage is answered here
            if getattr(error, "recovery", None) != "rebuild":
                raise
            outputs += self._rebuild(engine, error)
        self._track(outputs)
        return outputs

    # ---- liveness ---------------------------------------------------------------------------------
    def _watch(self, executor: ProcessExecutor) -> None:
        """A daemon thread that, once a stage dies or falls silent, marks `executor` failed, stops its
        stage processes and wakes the engine's thread."""
        stages = getattr(executor, "stages", None)
        if stages is None:
            return
        stop = threading.Event()
        self._watching[id(executor)] = stop

        def run() -> None:
            while not stop.wait(WATCH_INTERVAL_S):
                failure = stages.failure()
                if failure is None and executor.failure is None:
                    continue
                executor.abort(executor.failure or failure)  # a wait for tokens stage 0 is in ends now
                stages.stop()  # no orphans; a receive stage 0 is blocked in fails now
                self._wake()
                return

        threading.Thread(target=run, name="tessel-stage-watch", daemon=True).start()

    def _unwatch(self, executor: Any) -> None:
        stop = self._watching.pop(id(executor), None)
        if stop is not None:
            stop.set()

    def _wake(self) -> None:
        wake = getattr(self.engine, "wake", None)
        if wake is not None:
            wake()

    # ---- rebuild after a lost stage -----------------------------------------------------------------
    def _rebuild(self, engine: Any, error: BaseException) -> list:
        """A new pipeline in place of the broken one, the requests in flight moved into it; raises
        `PipelineDown` when none can be built or no rebuild is left."""
        if self.num_rebuilds >= self.max_rebuilds:
            raise PipelineDown(
                f"{_describe(error)}; the pipeline was rebuilt {self.num_rebuilds} times and no restarts "
                f"are left (--max-engine-restarts {self.max_rebuilds}): it stays down until the server "
                "restarts"
            ) from error
        self.num_rebuilds += 1
        self.recovering = error
        log.warning(
            "tessel: rebuilding the pipeline (%d of at most %d) after %s; %d requests in flight wait",
            self.num_rebuilds,
            self.max_rebuilds,
            _describe(error),
            engine.num_unfinished_requests,
        )
        started = time.monotonic()
        old = engine.executor
        self._unwatch(old)
        old.shutdown()
        try:
            options = self._survivors_options(old, error)
            moved = self._install(engine, self._replacement(options))
        except Exception as rebuild_error:
            self.recovering = None
            log.error("tessel: the pipeline rebuild failed: %s", _describe(rebuild_error))
            raise PipelineDown(
                f"{_describe(rebuild_error)} (rebuilding the pipeline after {_describe(error)})"
            ) from rebuild_error
        self.options = options
        report = RemapReport(
            f"rebuild after {_describe(error)}", str(options.plan), ok=True, moved=len(moved)
        )
        report.switch_s = time.monotonic() - started
        self._watch_gaps(moved, report, None)
        log.warning(
            "tessel: the pipeline is back after %.1f s with %d requests moved into it (cause: %s)",
            report.switch_s,
            report.moved,
            _describe(error),
        )
        self.retry_after_s = max(1, round(report.switch_s))
        self.recovering = None
        self.last_recovery = report
        return engine.drain_pending()

    def _replacement(self, options: RunOptions) -> ProcessExecutor:
        """The stages of a pipeline that replaces the serving one (after a loss, for a remap), spawned
        where `options.executor` says: processes here, or Ray actors on the plan's nodes."""
        return spawn_pipeline(options, _run_dir())

    def _install(self, engine: Any, executor: ProcessExecutor) -> list[str]:
        """Start `executor` (join it), move the engine's requests into it and watch it; -> moved ids.
        On a failure its processes are stopped and the error raised."""
        try:
            layout = executor.start(engine.setup_for(executor))
        except BaseException:
            executor.shutdown()
            raise
        moved = engine.replace_executor(executor, layout)
        self._watch(executor)
        return moved

    def _survivors_options(self, old: ProcessExecutor, error: BaseException) -> RunOptions:
        """What to build after a failure: without the lost stage's device (the plan re-split over the
        survivors, written to a new run directory), or the same pipeline when no stage is to blame."""
        from tessel.plan.remap.survivors import write_survivor_plan

        lost = _lost_stages(old.plan, error)
        if not lost:
            return self.options
        path = _run_dir() / f"plan-without-stage{'-'.join(map(str, sorted(lost)))}.json"
        write_survivor_plan(old.plan.plan_file, lost, path)
        log.warning(
            "tessel: stages %s (%s) are lost; re-planned on the %d stages left: %s",
            sorted(lost),
            ", ".join(old.plan.stages[k].device for k in sorted(lost)),
            len(old.plan.stages) - len(lost),
            path,
        )
        return replace(self.options, plan=path, replica=None)

    # ---- live remap -----------------------------------------------------------------------------------
    def remap(self, plan: Path | RunPlan, reason: str) -> Future:
        """Move serving to the pipeline of `plan` (a plan file, or a `RunPlan` read from one) without
        stopping: see the module. Callable from any thread."""
        done: Future = Future()
        path = plan.path if isinstance(plan, RunPlan) else Path(plan)
        replica = plan.replica if isinstance(plan, RunPlan) else None
        with self._lock:
            busy = self._remap is not None
            if not busy:
                options = replace(self.options, plan=path, replica=replica)
                self._remap = _Remap(options, RemapReport(reason, str(path), ok=False), done)
        if busy:
            done.set_exception(TesselError("a remap is already under way; wait for its future"))
            return done
        self._wake()
        return done

    def _advance_remap(self, engine: Any, outputs: list) -> None:
        remap = self._remap
        if remap is None:
            return
        if remap.state == "spawn":
            self._spawn(engine, remap)
        elif remap.state == "loaded":
            outputs += self._switch(engine, remap)

    def _spawn(self, engine: Any, remap: _Remap) -> None:
        """Engine thread (the children's parent-death signal follows it): the new stages spawned; their
        loading, and stage 0's here, on a background thread."""
        try:
            executor = self._replacement(remap.options)
        except Exception as error:  # a bad plan, refused before anything started
            self._remap = None
            remap.done.set_exception(error)
            return
        remap.executor, remap.state = executor, "loading"
        setup = engine.setup_for(executor)

        def load() -> None:
            started = time.monotonic()
            try:
                executor.load(setup)
                executor.wait_for_stages()
            except Exception as error:  # a new stage died, ran out of memory, ...
                executor.shutdown()
                remap.report.load_s = time.monotonic() - started
                self._finish_remap(remap, error, rolled_back=True)
                return
            remap.report.load_s = time.monotonic() - started
            remap.state = "loaded"
            self._wake()

        threading.Thread(target=load, name="tessel-remap-load", daemon=True).start()

    def _switch(self, engine: Any, remap: _Remap) -> list:
        """Engine thread, between two steps: the old pipeline's micro-batches finished, the old stages
        stopped, the new pipeline joined and the requests moved in; when joining fails, the old split
        built again and the requests moved there (rolled back)."""
        report, started = remap.report, time.monotonic()
        try:
            outputs = engine.drain()
        except Exception as error:  # noqa: BLE001 - the old pipeline broke meanwhile: recomputed
            log.warning("tessel: remap: the old pipeline failed while draining: %s", _describe(error))
            outputs = engine.drain_pending()
        old = engine.executor
        self._unwatch(old)
        old.shutdown()
        try:
            moved = self._install(engine, remap.executor)
        except Exception as join_error:
            report.error = f"joining the new pipeline failed: {_describe(join_error)}"
            log.error("tessel: remap (%s) failed: %s; rolling back", report.reason, report.error)
            try:
                moved = self._install(engine, self._replacement(self.options))
            except Exception as rollback_error:
                engine.executor.failure = PipelineDown(
                    f"{_describe(rollback_error)} (rolling back a failed remap: {report.error})"
                )
                self._finish_remap(remap, rollback_error, rolled_back=False)
                return outputs
            report.switch_s, report.moved = time.monotonic() - started, len(moved)
            self._finish_remap(remap, join_error, rolled_back=True)
            return outputs
        self.options = remap.options
        report.ok, report.switch_s, report.moved = True, time.monotonic() - started, len(moved)
        log.warning(
            "tessel: remapped (%s) to %s: loaded beside in %.1f s, switched in %.2f s, %d requests moved",
            report.reason,
            report.plan,
            report.load_s,
            report.switch_s,
            report.moved,
        )
        with self._lock:
            self._remap = None
        self._watch_gaps(moved, report, remap.done)
        return outputs + engine.drain_pending()

    def _finish_remap(self, remap: _Remap, error: BaseException | None, rolled_back: bool) -> None:
        with self._lock:
            self._remap = None
        report = remap.report
        if error is not None:
            report.ok = False
            report.error = report.error or _describe(error)
            report.rolled_back = rolled_back
            log.error("tessel: remap (%s) failed: %s", report.reason, report.error)
        if not remap.done.done():
            remap.done.set_result(report)

    # ---- how long a moved stream waited ------------------------------------------------------------
    def _watch_gaps(self, moved: list[str], report: RemapReport, done: Future | None) -> None:
        now = time.monotonic()
        self._gap_watch = {rid: self._last_token_s.get(rid, now) for rid in moved}
        report.max_gap_s = 0.0
        self._gap_report = (report, done)
        self._settle_gap()

    def _track(self, outputs: list) -> None:
        """Note when each stream got its last token; measure the gap of the streams a switch moved."""
        if not outputs:
            return
        now = time.monotonic()
        for output in outputs:
            rid = output.request_id
            since = self._gap_watch.pop(rid, None)
            if since is not None and self._gap_report is not None:
                report = self._gap_report[0]
                report.max_gap_s = max(report.max_gap_s or 0.0, now - since)
            if output.finished:
                self._last_token_s.pop(rid, None)
            else:
                self._last_token_s[rid] = now
        self._settle_gap()

    def _settle_gap(self) -> None:
        """Resolve a remap's future once every moved stream has its next token (or ended)."""
        if self._gap_report is None or self._gap_watch:
            return
        report, done = self._gap_report
        self._gap_report = None
        log.warning(
            "tessel: %s: the longest gap between two tokens of a moved stream was %.2f s",
            report.reason,
            report.max_gap_s,
        )
        if done is not None and not done.done():
            done.set_result(report)

    # ---- what /metrics shows ----------------------------------------------------------------------
    def stage_gauges(self) -> list[StageGauge]:
        """Per stage of the serving pipeline: its device, whether its process runs, its heartbeat's age."""
        executor = self.engine.executor
        plan, stages = executor.plan, executor.stages
        gauges = [StageGauge(0, plan.stages[0].device, True, None)]
        if stages is None:
            return gauges
        now = time.time()
        for rank in stages.ranks:
            up, age = stages.alive(rank), stages.beat_age_s(rank, now)
            gauges.append(StageGauge(rank, plan.stages[rank].device, up, age))
        return gauges


def _lost_stages(plan: RunPlan, error: BaseException) -> set[int]:
    """The stages the failure took (their positions): the one that failed, or every stage on its
    machine when the machine is lost; none when no stage is to blame, or for a flow plan, which is
    rebuilt as it is (no re-plan over the placements left yet)."""
    stage, node = getattr(error, "stage", None), getattr(error, "node", None)
    if is_flow(plan) or not (isinstance(stage, int) and 0 < stage < len(plan.stages)):
        return set()
    if node is None:
        return {stage}
    # a remote stage that died or fell silent: its machine may be gone (or cut off), so none of its
    # stages is counted on
    return {k for k, s in enumerate(plan.stages) if k > 0 and s.device.split("/", 1)[0] == node}


def _run_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="tessel-serve-"))
