"""`tessel serve --plan`: the server process is stage 0 and spawns the other stages.

`pipeline_engine(...)` checks the plan against the model, spawns stages 1..S-1 on this machine,
joins them in one process group and returns the `PipelineEngine`, which the server drives like an
`LLMEngine`. `watch(engine, wake)` polls the stage processes and their heartbeats: when one dies,
falls silent (SIGSTOP, a hang) or the pipeline is stuck, the engine is marked failed with a
`StageFailedError` naming the stage and the cause, the other stages are stopped (which also ends a
receive stage 0 is blocked in) and `wake()` makes the server's engine thread take its next step,
which raises the failure. A restart of the engine loop cannot bring a stage back; a new pipeline
can (`StageFailedError.recovery` is "rebuild"): `engine.serve_with(async_engine)` starts the
watcher and lets the server's `AsyncEngine` call `engine.rebuilt(async_engine)`, which stops the
old stages, destroys the process group, spawns new stages on a new port, joins them in a new
group and returns a new engine that the server drives from then on (see
`tessel.server.async_engine`). The new stages are spawned from the server's engine thread, and
`PR_SET_PDEATHSIG` ends them when that thread ends: when the server stops, or gives up the engine.
"""

from __future__ import annotations

import atexit
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from tessel.models.config import resolve_dtype
from tessel.pipeline.chunk_cutter import ChunkCutter
from tessel.pipeline.comm import PeerLostError
from tessel.pipeline.driver import PipelineEngine
from tessel.pipeline.heartbeat import read_beat
from tessel.pipeline.launcher import POLL_S, LocalStages, StageFailedError, free_port
from tessel.pipeline.run import RunOptions
from tessel.pipeline.run_plan import priced_pipeline
from tessel.pipeline.worker import engine_kwargs, join_pipeline, parser, validate

WATCH_INTERVAL_S = 0.5
EXPLAIN_SETTLE_S = 5.0  # after a lost peer, how long to wait for the dead stage's process to exit


@dataclass(frozen=True, slots=True)
class StageGauge:
    """One stage as `/metrics` shows it (`tessel.server.prometheus`, labels `stage` and `device`)."""

    stage: int
    device: str  # the plan's device name
    up: bool  # its process runs (stage 0 is the server process itself)
    heartbeat_age_s: float | None  # seconds since its last heartbeat (None: stage 0, or no beat yet)


class ServedPipelineEngine(PipelineEngine):
    """A `PipelineEngine` whose other stages are this process's children."""

    stages: LocalStages
    options: RunOptions  # what it was built from: `rebuilt` builds the same pipeline again
    _unwatched: threading.Event

    def watch_stages(self, async_engine) -> threading.Thread:
        """Watch the stage processes; on a death, fail the engine and wake the server's engine thread."""
        wake = lambda: async_engine.submit(lambda: None)  # noqa: E731
        return watch(self, self.stages, wake, self._unwatched)

    def serve_with(self, async_engine) -> None:
        """Watch the stages, and let `async_engine` rebuild the pipeline after a stage failure."""
        async_engine.rebuild = lambda broken: broken.rebuilt(async_engine)
        self.watch_stages(async_engine)

    def rebuilt(self, async_engine) -> ServedPipelineEngine:
        """Stop this pipeline and build the same one again (new stage processes, new process group),
        watched for `async_engine`; raises (a `StageFailedError`, ...) when the new one fails to start."""
        self.close()
        engine = pipeline_engine(self.options)
        engine.watch_stages(async_engine)
        return engine

    def stage_gauges(self) -> list[StageGauge]:
        """Per stage of this pipeline: its device, whether its process runs, its heartbeat's age."""
        now = time.time()
        gauges = [StageGauge(0, self.plan.stages[0].device, True, None)]
        for rank, proc in enumerate(self.stages.procs, start=1):
            beat = read_beat(self.stages.run_dir, rank)
            age = None if beat is None else max(now - beat.time_s, 0.0)
            gauges.append(StageGauge(rank, self.plan.stages[rank].device, proc.poll() is None, age))
        return gauges

    def close(self) -> None:
        self._unwatched.set()
        self.stages.stop()
        atexit.unregister(self.stages.stop)
        if dist.is_initialized():
            dist.destroy_process_group()


def pipeline_engine(options: RunOptions, run_dir: Path | None = None) -> ServedPipelineEngine:
    args = parser().parse_args(options.worker_argv(Path("unused.json")))
    plan, config = validate(args)
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="tessel-serve-"))
    port = free_port()
    argv = options.worker_argv(run_dir / "unused.json")
    stages = LocalStages(argv, len(plan.stages), run_dir, port, options.heartbeat_timeout)
    atexit.register(stages.stop)
    try:
        comm = None
        if len(plan.stages) > 1:
            _wait_for_first_beats(stages)
            dtype = resolve_dtype(args.dtype, config)
            comm = join_pipeline(plan, 0, args.transport, dtype, f"tcp://127.0.0.1:{port}")
            stages.stage0_progress = comm.progress  # the watchdog sees stage 0 wait for tokens
        cutter = None
        if options.cpp and len(plan.stages) > 1:
            cutter = ChunkCutter(priced_pipeline(plan, options.profiles), options.cpp_min_tokens)
        engine = ServedPipelineEngine(
            options.model,
            plan,
            comm,
            micro_batches=options.micro_batches,
            cutter=cutter,
            **engine_kwargs(args),
        )
    except BaseException:
        stages.stop()
        atexit.unregister(stages.stop)
        if dist.is_initialized():
            dist.destroy_process_group()  # so a later build (a rebuild) can join a new group
        raise
    engine.stages, engine.options, engine._unwatched = stages, options, threading.Event()
    engine.explain_peer_lost = lambda error: _explain(stages, error)
    return engine


def _wait_for_first_beats(stages: LocalStages) -> None:
    """Wait until every stage process beats (it runs `tessel.pipeline.worker` and is about to join the
    process group), so a stage that dies while starting raises its `StageFailedError` here instead of
    leaving stage 0 waiting for it in `init_process_group`."""
    while not all(read_beat(stages.run_dir, rank) is not None for rank in range(1, len(stages.procs) + 1)):
        failure = stages.failure()
        if failure is not None:
            raise failure
        time.sleep(POLL_S)


def pipeline_server_engine(model: Path, plan: Path, **engine_options) -> ServedPipelineEngine:
    """The engine `tessel serve --plan` drives; `engine.watch_stages(async_engine)` starts the watcher."""
    names = {"dtype", "max_num_seqs", "max_model_len", "kv_cache_gib", "replica", "heartbeat_timeout"}
    unknown = set(engine_options) - names
    if unknown:
        raise TypeError(f"unexpected engine options {sorted(unknown)}")
    return pipeline_engine(RunOptions(plan, model, **engine_options))


def _explain(stages: LocalStages, error: PeerLostError) -> BaseException:
    """The stage failure behind a lost peer (the one the watcher found, or a stage that exits within
    `EXPLAIN_SETTLE_S`), else the lost peer itself."""
    return stages.failure(settle_s=EXPLAIN_SETTLE_S) or error


def watch(
    engine: PipelineEngine,
    stages: LocalStages,
    wake: Callable[[], object],
    stop: threading.Event | None = None,
) -> threading.Thread:
    """A daemon thread that, once a stage dies or falls silent (or the engine lost a peer), marks the
    engine failed, stops every stage process and calls `wake`; it ends early once `stop` is set."""
    stop = stop or threading.Event()

    def run() -> None:
        while not stop.wait(WATCH_INTERVAL_S):
            failure = stages.failure()
            if failure is None and engine.failure is None:
                continue
            if engine.failure is None:
                engine.failure = failure
            stages.stop()  # no orphans; a receive stage 0 is blocked in fails now
            wake()
            return

    thread = threading.Thread(target=run, name="tessel-stage-watch", daemon=True)
    thread.start()
    return thread


__all__ = ["StageFailedError", "StageGauge", "pipeline_engine", "pipeline_server_engine", "watch"]
