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
old stages, destroys the process group, re-plans on the stages left (`survivors_options`,
`tessel.plan.remap.survivors.survivor_plan`), spawns their new processes on a new port, joins them in a
new group and returns a new engine that the server drives from then on, with the requests in flight
moved into it (see `tessel.server.async_engine`). The new stages are spawned from the server's
engine thread, and `PR_SET_PDEATHSIG` ends them when that thread ends: when the server stops, or
gives up the engine.

A pipeline is built in three steps (`PendingPipeline`): its stage processes are spawned (they load
their layers, pack their linears, then wait to join), stage 0's layers and tokenizer are loaded in
this process (`load`, any thread, while an old pipeline may still serve), and the process group is
joined and stage 0's engine built (`join`, the engine thread, once no other group is up). A live
remap (`engine.successor(plan)`, `AsyncEngine.remap`) runs `load` beside the serving pipeline and
`join` at the switch; `pipeline_engine` runs all three at once.
"""

from __future__ import annotations

import atexit
import logging
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
from tessel.pipeline.flow_routing import FlowEngineMixin
from tessel.pipeline.heartbeat import read_beat
from tessel.pipeline.launcher import POLL_S, LocalStages, StageFailedError, free_port
from tessel.pipeline.run import RunOptions
from tessel.pipeline.run_plan import RunPlan, priced_pipeline
from tessel.pipeline.worker import engine_kwargs, join_pipeline, parser, validate

WATCH_INTERVAL_S = 0.5
EXPLAIN_SETTLE_S = 5.0  # after a lost peer, how long to wait for the dead stage's process to exit

log = logging.getLogger(__name__)


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

    def __init__(self, *args, preloaded: tuple | None = None, **kwargs) -> None:
        self._preloaded = preloaded  # stage 0's layers, loaded beside the old pipeline (`PendingPipeline`)
        super().__init__(*args, **kwargs)
        self._preloaded = None

    def _load_model(self, path: Path):
        if self._preloaded is None:
            return super()._load_model(path)
        model, loaded, _ = self._preloaded
        vars(self).update(loaded)  # what `PipelineEngine._load_model` set besides the model
        return model

    def _load_tokenizer(self, path: Path):
        if self._preloaded is None:
            return super()._load_tokenizer(path)
        return self._preloaded[2]

    def watch_stages(self, async_engine) -> threading.Thread:
        """Watch the stage processes; on a death, fail the engine and wake the server's engine thread."""
        wake = lambda: async_engine.submit(lambda: None)  # noqa: E731
        return watch(self, self.stages, wake, self._unwatched)

    def serve_with(self, async_engine) -> None:
        """Watch the stages, and let `async_engine` rebuild the pipeline after a stage failure."""
        async_engine.rebuild = lambda broken: broken.rebuilt(async_engine)
        self.watch_stages(async_engine)

    def rebuilt(self, async_engine) -> ServedPipelineEngine:
        """Stop this pipeline and build a new one (new stage processes, new process group), watched
        for `async_engine`: after a lost stage, on the surviving stages (`survivors_options`), else
        the same one again; raises (`SurvivorsTooSmallError`, a `StageFailedError`, ...) when the new
        one cannot be built. The server moves the requests in flight into it."""
        self.close()
        engine = pipeline_engine(self.survivors_options())
        engine.watch_stages(async_engine)
        return engine

    def restarted(self, async_engine) -> ServedPipelineEngine:
        """This pipeline's split built again (new stage processes; this one is closed), watched for
        `async_engine`: where a failed remap rolls back to."""
        self.close()
        engine = pipeline_engine(self.options)
        engine.watch_stages(async_engine)
        return engine

    def lost_stage(self) -> int | None:
        """The stage whose failure broke this pipeline (its position), or None."""
        failure = self.failure
        stage = getattr(failure, "stage", None)
        if self.plan.paths:
            return None  # a flow plan is rebuilt as it is (no re-plan over the placements left yet)
        return stage if isinstance(stage, int) and 0 < stage < len(self.plan.stages) else None

    def survivors_options(self) -> RunOptions:
        """What to build after a failure: without the lost stage's device (the plan re-split over the
        survivors by memory, `tessel.plan.remap.survivors.survivor_plan`, written to this run's directory),
        or the same pipeline when no stage is to blame."""
        from dataclasses import replace

        from tessel.plan.remap.survivors import write_survivor_plan

        lost = self.lost_stage()
        if lost is None:
            return self.options
        path = self.stages.run_dir / f"plan-without-stage{lost}.json"
        write_survivor_plan(self.plan.plan_file, {lost}, path)
        log.warning(
            "tessel: stage %d (%s) is lost; re-planned on the %d stages left: %s",
            lost,
            self.plan.stages[lost].device,
            len(self.plan.stages) - 1,
            path,
        )
        return replace(self.options, plan=path, replica=None)

    def successor(self, plan: Path | RunPlan) -> PendingPipeline:
        """Spawn the stage processes of `plan` (a plan file, or a `RunPlan` read from one) beside this
        pipeline, with this one's options; call on the server's engine thread."""
        from dataclasses import replace

        path = plan.path if isinstance(plan, RunPlan) else Path(plan)
        replica = plan.replica if isinstance(plan, RunPlan) else None
        return PendingPipeline(replace(self.options, plan=path, replica=replica))

    def drain(self) -> list:
        """Finish the micro-batches in flight without launching more; -> their outputs."""
        outputs, self._pending = self._pending, []
        while self._in_flight:
            outputs.extend(self._complete(self._in_flight.popleft()))
        return outputs

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


class ServedFlowPipelineEngine(FlowEngineMixin, ServedPipelineEngine):
    """Rank 0 of a flow plan's placements, served (`tessel.pipeline.flow_routing`)."""


class PendingPipeline:
    """A pipeline being built beside the one that serves: its stage processes (spawned by
    `spawn_pipeline`, on the server's engine thread so `PR_SET_PDEATHSIG` ties them to it) load their
    layers and then wait to join; `load()` (any thread) loads stage 0's layers here and waits until
    every stage has loaded; `join()` (the engine thread, once the old process group is gone) joins
    the new group and returns the new engine; `abandon()` stops its processes."""

    def __init__(self, options: RunOptions, run_dir: Path | None = None) -> None:
        args = parser().parse_args(options.worker_argv(Path("unused.json")))
        self.plan, self.config = validate(args)
        self.options, self.args = options, args
        self.run_dir = run_dir or Path(tempfile.mkdtemp(prefix="tessel-serve-"))
        self.port = free_port()
        argv = options.worker_argv(self.run_dir / "unused.json")
        timeout = options.heartbeat_timeout
        self.stages = LocalStages(argv, len(self.plan.stages), self.run_dir, self.port, timeout)
        atexit.register(self.stages.stop)
        self.preloaded = None  # stage 0's (model, attributes its loading set, tokenizer), once `load` ran
        self._joining = False

    def load(self, timeout_s: float | None = None) -> None:
        """Load stage 0's layers in this process and wait until every other stage has loaded its own;
        raises the `StageFailedError` of a stage that died (out of memory, ...) while loading."""
        from types import SimpleNamespace

        import torch

        from tessel.engine.engine_config import EngineConfig
        from tessel.engine.llm_engine import _load_tokenizer as load_tokenizer
        from tessel.layers.linear import pack_linears
        from tessel.pipeline.devices import stage_device

        device = stage_device(self.plan.stages[0])
        loader = SimpleNamespace(
            plan=self.plan,
            model_config=self.config,
            dtype=resolve_dtype(self.args.dtype, self.config),
            config=EngineConfig(**{**engine_kwargs(self.args), "device": device}),
        )
        given = set(vars(loader))
        model = PipelineEngine._load_model(loader, self.options.model)  # stage 0's own loading
        if loader.config.pack_cpu_linears and torch.device(device).type == "cpu":
            pack_linears(model)  # now, not in the switch (the `ModelRunner` then finds them packed)
        loaded = {key: value for key, value in vars(loader).items() if key not in given}
        self.preloaded = (model, loaded, load_tokenizer(self.options.model))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not all(_loaded(self.run_dir, rank) for rank in range(1, len(self.plan.stages))):
            failure = self.stages.failure()
            if failure is not None:
                raise failure
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the new stages did not load their layers within {timeout_s:g} s")
            time.sleep(POLL_S)

    def join(self) -> ServedPipelineEngine:
        """Join the new process group (none may be initialized) and build stage 0's engine."""
        options, args, plan, stages = self.options, self.args, self.plan, self.stages
        self._joining = True  # from here on, a process group is this pipeline's
        try:
            comm = None
            if len(plan.stages) > 1:
                _wait_for_first_beats(stages)
                failure = stages.failure()  # a new stage that died after loading: do not wait for it
                if failure is not None:
                    raise failure
                dtype = resolve_dtype(args.dtype, self.config)
                comm = join_pipeline(plan, 0, args.transport, dtype, f"tcp://127.0.0.1:{self.port}")
                stages.stage0_progress = comm.progress  # the watchdog sees stage 0 wait for tokens
            cutter = None
            if options.cpp and len(plan.stages) > 1 and not plan.paths:
                cutter = ChunkCutter(priced_pipeline(plan, options.profiles), options.cpp_min_tokens)
            engine = (ServedFlowPipelineEngine if plan.paths else ServedPipelineEngine)(
                options.model,
                plan,
                comm,
                micro_batches=options.micro_batches,
                cutter=cutter,
                preloaded=self.preloaded,
                **engine_kwargs(args),
            )
        except BaseException:
            self.abandon()
            raise
        self.preloaded = None
        engine.stages, engine.options, engine._unwatched = stages, options, threading.Event()
        engine.explain_peer_lost = lambda error: _explain(stages, error)
        return engine

    def abandon(self) -> None:
        """Stop its stage processes and leave any process group it joined."""
        self.stages.stop()
        atexit.unregister(self.stages.stop)
        if self._joining and dist.is_initialized():  # never the serving pipeline's group
            dist.destroy_process_group()  # so a later build (a rebuild) can join a new group


def _loaded(run_dir: Path, rank: int) -> bool:
    from tessel.pipeline.launcher import read_status

    return read_status(run_dir, rank).get("state") in ("loaded", "ready")


def pipeline_engine(options: RunOptions, run_dir: Path | None = None) -> ServedPipelineEngine:
    """Spawn the plan's stages, load stage 0's layers here while they load theirs, join them."""
    pending = PendingPipeline(options, run_dir)
    try:
        pending.load()
    except BaseException:
        pending.abandon()
        raise
    return pending.join()


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
    names |= {"preemption_mode", "host_kv_cache_gib", "emulate_host_gbps"}
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


__all__ = [
    "PendingPipeline",
    "StageFailedError",
    "StageGauge",
    "pipeline_engine",
    "pipeline_server_engine",
    "watch",
]
