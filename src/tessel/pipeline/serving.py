"""`tessel serve --plan`: the server process is stage 0 and spawns the other stages.

`pipeline_engine(...)` checks the plan against the model, spawns stages 1..S-1 on this machine,
joins them in one process group and returns the `PipelineEngine`, which the server drives like an
`LLMEngine`. `watch(engine, wake)` polls the stage processes and their heartbeats: when one dies,
falls silent (SIGSTOP, a hang) or the pipeline is stuck, the engine is marked failed with a
`StageFailedError` naming the stage and the cause, the other stages are stopped (which also ends a
receive stage 0 is blocked in) and `wake()` makes the server's engine thread take its next step,
which raises the failure. A restart of the engine loop cannot bring a stage back
(`StageFailedError.restart_can_fix` is False), so the server stays up without a pipeline: in-flight
and new requests get 503 and `/health` answers 503 naming the stage, until the server is restarted.
"""

from __future__ import annotations

import atexit
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from tessel.models.config import resolve_dtype
from tessel.pipeline.chunk_cutter import ChunkCutter
from tessel.pipeline.comm import PeerLostError, StageComm
from tessel.pipeline.driver import PipelineEngine
from tessel.pipeline.launcher import LocalStages, StageFailedError, free_port
from tessel.pipeline.run import RunOptions
from tessel.pipeline.run_plan import priced_pipeline
from tessel.pipeline.worker import COMM_TIMEOUT, device_for, engine_kwargs, parser, validate

WATCH_INTERVAL_S = 0.5
EXPLAIN_SETTLE_S = 5.0  # after a lost peer, how long to wait for the dead stage's process to exit


class ServedPipelineEngine(PipelineEngine):
    """A `PipelineEngine` whose other stages are this process's children."""

    stages: LocalStages

    def watch_stages(self, async_engine) -> threading.Thread:
        """Watch the stage processes; on a death, fail the engine and wake the server's engine thread."""
        return watch(self, self.stages, lambda: async_engine.submit(lambda: None))

    def close(self) -> None:
        self.stages.stop()
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
            dist.init_process_group(
                plan.backend,
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=len(plan.stages),
                timeout=COMM_TIMEOUT,
            )
            comm = StageComm(0, len(plan.stages), device_for(plan, 0), resolve_dtype(args.dtype, config))
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
        raise
    engine.stages = stages
    engine.explain_peer_lost = lambda error: _explain(stages, error)
    return engine


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


def watch(engine: PipelineEngine, stages: LocalStages, wake: Callable[[], object]) -> threading.Thread:
    """A daemon thread that, once a stage dies or falls silent (or the engine lost a peer), marks the
    engine failed, stops every stage process and calls `wake`."""

    def run() -> None:
        stop = threading.Event()
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


__all__ = ["StageFailedError", "pipeline_engine", "pipeline_server_engine", "watch"]
