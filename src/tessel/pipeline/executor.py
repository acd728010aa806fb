"""A plan's pipeline as the engine's executor: stage 0's layers in this process, the other stages in
processes of their own, over torch.distributed.

`ProcessExecutor` is what `LLMEngine` runs its steps on for a plan (`tessel serve --plan`, rank 0 of
`tessel launch` and of torchrun). Every plan runs as paths over its stages (`tessel.pipeline.flow`):
a pipeline is one path, a flow plan several through shared placements. A micro-batch the engine
launches is prepared by stage 0's `ModelRunner` (flat tokens, slot mapping, block tables), run
through stage 0's layers (`StageRunner`) and sent on along its slot's path with its metadata
(`BatchMessage`); the path's last stage samples it and sends the tokens back, which a thread takes
as they come (`tessel.pipeline.comm.tokens`); `collect` turns them into the engine's `StepResult`.
A path that does not start on rank 0 gets its micro-batch's token ids instead of a stream.

The other stages are either this process's children (`spawn`: the supervisor watches them and
builds a new executor after a loss or for a live remap, `tessel.pipeline.supervision.supervisor`),
or were started by someone else who watches them (`tessel launch`'s launcher, torchrun). A pipeline
is built in steps so a new one can load beside one that serves: `spawn` starts the stage processes
(they load their layers, then wait to join), `load` loads stage 0's layers here (any thread), and
`start` joins the process group, agrees the KV layout with every stage and returns the engine's
`ExecutorLayout`.

Async scheduling (the engine's `async_scheduling`, `--async-scheduling` on `serve --plan`): stage 0
computes each decode micro-batch and sends it on from a worker thread, so `launch` returns once the
micro-batch is prepared and the engine schedules and prepares the next slot's micro-batch while
stage 0 computes (different sequences: a slot's next micro-batch is scheduled only after its last
one's tokens are back, so nothing runs ahead of its own tokens). Micro-batches leave stage 0 in
launch order: one worker, and a prefill (timed on the engine's thread for preemption's clock) or a
micro-batch sent straight to a path that starts elsewhere waits for the worker's queue first.
Refused where stage 0 is tensor-parallel.

Preemption: stage 0 swaps or recomputes as one process does (its emulated host link from the plan
unless `emulate_host_gbps` is given); every stage holds its own layers' KV blocks, so stage 0's copies
to and from its host pool travel with the next micro-batch (`KvCopies`) and each stage repeats them
on its layers before computing it: stages take micro-batches in order, so a block is copied out
before a later batch reuses it and copied in before the batch that reads it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tessel.engine.emulation import SlowDevice
from tessel.engine.engine_config import EngineConfig
from tessel.engine.executor import EngineSetup, ExecutorLayout, InFlightBatch, KvCopies
from tessel.engine.model_runner import ModelRunner, StepResult, kv_cache_bytes_per_block
from tessel.engine.slots import SlotPath
from tessel.engine.weight_stream import host_copy
from tessel.errors import TesselError
from tessel.layers.linear import pack_linears
from tessel.models.layer_filter import LayerFilter
from tessel.models.llama import LlamaForCausalLM
from tessel.models.loader import load_model
from tessel.models.quantized.load_quantize import quantize_layers
from tessel.parallel.executor import SWAP_REFUSED
from tessel.parallel.runner import LeaderRunner
from tessel.parallel.stage import TPStage, load_tp_stage
from tessel.pipeline.chunk_cutter import ChunkCutter
from tessel.pipeline.comm.group import join_pipeline
from tessel.pipeline.comm.handshake import agree_flow_blocks, agree_kv_layout
from tessel.pipeline.comm.links import StageComm
from tessel.pipeline.comm.messages import BatchMessage, KvLayout, PeerLostError
from tessel.pipeline.devices import stage_device
from tessel.pipeline.flow import FlowBlocks, PathFeatures, flow_max_seqs, path_of_slots, plan_paths
from tessel.pipeline.options import RunOptions
from tessel.pipeline.run_plan import RunPlan, load_run_plan, priced_pipeline
from tessel.pipeline.stage.runner import KvBudget, StageRunner, StageStats, rss_bytes, tensor_bytes
from tessel.pipeline.supervision.launcher import LocalStages
from tessel.ports import port_of, reserve_port

EXPLAIN_SETTLE_S = 5.0  # after a lost peer, how long to wait for the dead stage's process to exit
WORKER_POLL_S = 0.05  # how often a wait for stage 0's worker looks for a lost stage

__all__ = ["ProcessExecutor", "layer_filter", "stage_kv_budget"]


def stage_kv_budget(plan: RunPlan, rank: int, kv_cache_gib: float | None) -> KvBudget:
    stage = plan.stages[rank]
    total = plan.num_layers or max(s.layer_end for s in plan.stages)
    return KvBudget(kv_cache_gib, stage.kv_gib, stage.num_layers / total)


def layer_filter(plan: RunPlan, rank: int, tied: bool) -> LayerFilter:
    """Stage `rank`'s part: its layers, the embedding where its layers start at 0, the final norm and
    head where they end the model (a pipeline's first and last stage; a flow plan's placements)."""
    stage = plan.stages[rank]
    return LayerFilter(
        stage.layer_start,
        stage.layer_end,
        embed=stage.layer_start == 0,
        head=stage.layer_end == max(s.layer_end for s in plan.stages),
        tied=tied,
        host_layers=frozenset(stage.offload_layers),  # streamed from host memory (weight_stream)
    )


@dataclass(slots=True)
class Stage0:
    """Stage 0's layers loaded in this process, before the pipeline joins."""

    model: LlamaForCausalLM
    part: LayerFilter
    weight_bytes: int
    rss_before_load_bytes: int
    host_weights: object | None  # the streamed layers' host copy (`tessel.engine.weight_stream`)
    tp: TPStage | None = None  # stage 0's tensor-parallel ranks, when its plan stage splits it


class ProcessExecutor:
    runs_ahead = False  # no step is launched before its own last tokens are applied (run_ahead)

    def __init__(
        self,
        options: RunOptions,
        stages: LocalStages | None = None,
        init_method: str | None = None,
        *,
        comm: StageComm | None = None,
        cutter: ChunkCutter | None = None,
        listener: socket.socket | None = None,
    ) -> None:
        """`stages`: the other stages as this process's children (`spawn`), or None when someone else
        started them; `init_method`: the process group's rendezvous (None: torchrun's environment);
        `comm`: links already made (a test's loopback) instead of joining; `cutter`: the CPP cut to use
        instead of the plan's; `listener`: the rendezvous port, bound here since the stages were
        started (`tessel.ports`), until the group's store listens on it."""
        self.options, self.stages, self.init_method = options, stages, init_method
        self._listener = listener
        self.plan = load_run_plan(options.plan, options.replica)
        self.paths = plan_paths(self.plan, options.micro_batches)
        self.features = PathFeatures.of(self.plan)
        self.failure: BaseException | None = None
        self.comm: StageComm | None = comm
        self.stage: StageRunner | None = None
        self.cutter: ChunkCutter | None = cutter
        self._loaded: Stage0 | None = None
        self._path_of_slot = path_of_slots(self.paths)
        self._path_of_seq: dict[int, int] = {}  # until its release reaches its path's last stage
        self._released: list[list[int]] = [[] for _ in self.paths]
        self._resume: dict[int, int] = {}  # seeded requests moved in: sequence id -> noise draws made
        self._fresh_stats = False  # the next micro-batch tells the other stages to count anew
        self.on_phase: Callable[[str], object] | None = None  # told "joining" before the join (a heartbeat)
        self.kv_blocks = 0  # stage 0's own pool, once started
        self.overlaps = False  # async scheduling: stage 0's decode micro-batches on `_worker` (configure)
        self._worker: ThreadPoolExecutor | None = None
        self._queued: Future | None = None  # the last micro-batch given to the worker
        self.num_overlapped = 0  # micro-batches stage 0 computed on the worker

    @classmethod
    def spawn(cls, options: RunOptions, run_dir: Path) -> ProcessExecutor:
        """Start the plan's other stages as this process's children (they load their layers, then wait
        to join); the executor joins them in `start`. Call on a thread that lives as long as they do
        (their `PR_SET_PDEATHSIG` follows it)."""
        plan = load_run_plan(options.plan, options.replica)
        listener = reserve_port("127.0.0.1")
        port = port_of(listener)
        stages = None
        try:
            if len(plan.stages) > 1:
                options_file = options.write(run_dir / "run-options.json")
                stages = LocalStages(options_file, len(plan.stages), run_dir, port, options.heartbeat_timeout)
        except BaseException:
            listener.close()
            raise
        return cls(options, stages, f"tcp://127.0.0.1:{port}", listener=listener)

    # ---- before joining ---------------------------------------------------------------------------
    def configure(self, config: EngineConfig) -> EngineConfig:
        """The engine's settings on this plan: stage 0's device, eager steps where it streams layers
        (forward hooks copy them in), its emulated host link, no prefix cache over several paths."""
        from dataclasses import replace

        stage = self.plan.stages[0]
        changes: dict = {"device": stage_device(stage)}
        if stage.offload_layers:
            changes["enforce_eager"] = True
        if config.emulate_host_gbps is None and stage.emulate_host_gbps is not None:
            changes["emulate_host_gbps"] = stage.emulate_host_gbps
        if not self.features.prefix_caching:
            changes["enable_prefix_caching"] = False
        if config.async_scheduling:
            if stage.tp_degree > 1:
                raise TesselError(
                    "async_scheduling: stage 0 of this plan is tensor-parallel; its ranks do not overlap "
                    "their steps yet"
                )
            self.overlaps = True
        return replace(config, **changes)

    def load(self, setup: EngineSetup) -> None:
        """Stage 0's layers in this process (any thread; once)."""
        if self._loaded is not None:
            return
        config = setup.config
        part = layer_filter(self.plan, 0, setup.model_config.tie_word_embeddings)
        rss_before = rss_bytes()
        stage = self.plan.stages[0]
        quantized = stage.quantized_layers
        tp = None
        if stage.tp_degree > 1:  # the ranks round the plan's precisions as they load
            gpus = list(stage.tp_gpus) if stage.tp_gpus is not None else None
            run_dir = self.options.run_dir
            tp = load_tp_stage(
                setup.model_path,
                setup.dtype,
                config.device,
                part,
                stage.tp_degree,
                0,
                gpus,
                run_dir,
                quantized,
            )
            model = tp.model
        else:
            model = load_model(setup.model_path, setup.dtype, config.device, layers=part)
            if quantized:
                quantize_layers(model, quantized, setup.dtype)
        weight_bytes = tensor_bytes(model)
        host_weights = host_copy(model, part) if part.host_layers else None  # before the runner packs them
        if config.pack_cpu_linears and torch.device(config.device).type == "cpu" and host_weights is None:
            pack_linears(model)  # now, not when joining (the `ModelRunner` then finds them packed)
        self._loaded = Stage0(model, part, weight_bytes, rss_before, host_weights, tp)

    def wait_for_stages(self, timeout_s: float | None = None) -> None:
        """Wait until every other stage has loaded its layers; raises the failure of one that died
        (out of memory, ...) or fell silent meanwhile."""
        if self.stages is not None:
            self.stages.wait_loaded(timeout_s)

    # ---- joining ----------------------------------------------------------------------------------
    def start(self, setup: EngineSetup) -> ExecutorLayout:
        """Load stage 0 (unless `load` did), join the other stages, agree the KV layout with them."""
        self.load(setup)
        self.wait_for_stages()
        config, loaded = setup.config, self._loaded
        device = torch.device(config.device)
        if len(self.plan.stages) > 1 and self.comm is None:
            if self.on_phase is not None:
                self.on_phase("joining")
            options = self.options
            listen_fd = None if self._listener is None else self._listener.detach()  # the store's now
            self._listener = None
            self.comm = join_pipeline(
                self.plan,
                0,
                options.transport,
                setup.dtype,
                self.init_method,
                options.micro_batches,
                listen_fd,
            )
            if self.stages is not None:
                self.stages.stage0_progress = self.comm.progress  # the watchdog sees stage 0 wait
        bs = config.block_size
        per_block = kv_cache_bytes_per_block(loaded.model, bs, setup.dtype)
        blocks_per_seq = -(-setup.max_model_len // bs)
        budget = stage_kv_budget(self.plan, 0, config.kv_cache_gib)
        capacity = config.num_kv_blocks or budget.blocks(
            per_block, blocks_per_seq, flow_max_seqs(self.paths, config.max_num_seqs)
        )
        mine = KvLayout(capacity, bs, config.pack_cpu_linears, config.max_num_seqs, setup.max_model_len)
        layout = agree_kv_layout(capacity, mine) if self.comm is not None else mine
        blocks = self._blocks(layout, capacity)
        held = blocks.local_blocks
        if held < blocks_per_seq:
            raise TesselError(
                f"the pipeline's KV cache holds {held * bs} tokens ({held} blocks of {bs} in the smallest "
                f"stage's budget), fewer than max_model_len={setup.max_model_len}; raise --kv-cache-gib or "
                "lower --max-model-len"
            )
        self.kv_blocks = blocks.local_blocks
        self._build_stage(setup, loaded, blocks.local_blocks, device)
        if self.cutter is None and self.options.cpp and self.features.cpp and len(self.plan.stages) > 1:
            self.cutter = ChunkCutter(
                priced_pipeline(self.plan, self.options.profiles), self.options.cpp_min_tokens
            )
        one = len(self.paths) == 1
        return ExecutorLayout(
            blocks.local_blocks,
            tuple(SlotPath(p.weight, p.micro_batches) for p in self.paths),
            None if one else blocks.ranges,
            kv_cache=self.runner.kv_cache,
            kv_layer_share=budget.layer_share,
            records_kv_copies=len(self.plan.stages) > 1,
            swap_refused=self.features.swap_refused or self._tp_swap_refused(),
        )

    def _tp_swap_refused(self) -> str | None:
        """Swapping is refused where a stage is split over ranks (its followers would not repeat the
        host copies of its KV blocks)."""
        if any(s.tp_degree > 1 for s in self.plan.stages):
            return SWAP_REFUSED
        return None

    def _blocks(self, layout: KvLayout, capacity: int) -> FlowBlocks:
        """Rank 0's view of the block ids: one pool of the agreed size on one path; each path's range
        (agreed with every stage, each offering what its own budget holds) on several."""
        if len(self.paths) == 1:
            return FlowBlocks([(0, layout.num_blocks)], layout.num_blocks, None, layout.block_size)
        if self.comm is None:
            from tessel.pipeline.flow import path_block_ranges

            per_seq = -(-layout.max_model_len // layout.block_size)
            ranges = path_block_ranges(self.paths, [capacity], per_seq, layout.max_num_seqs)
            return FlowBlocks.for_rank(self.paths, ranges, 0, layout.block_size)
        return agree_flow_blocks(self.paths, 0, capacity, layout)

    def _build_stage(self, setup: EngineSetup, loaded: Stage0, num_blocks: int, device: torch.device) -> None:
        config, stage = setup.config, self.plan.stages[0]
        if loaded.tp is not None:
            self.runner = LeaderRunner(
                loaded.tp.group,
                loaded.model,
                num_blocks,
                config.block_size,
                setup.dtype,
                config.pack_cpu_linears,
            )
        else:
            self.runner = ModelRunner(
                loaded.model,
                num_blocks,
                config.block_size,
                setup.dtype,
                config.pack_cpu_linears,
                config.enforce_eager,
                device,
                config.max_num_seqs,
                setup.max_model_len,
            )
        self.model = loaded.model
        publish = any(s.emulate_schedule for s in self.plan.stages)  # later stages count from stage 0's
        slow = SlowDevice(stage.emulate_speed, stage.emulate_schedule, publish_epoch=publish)
        self.stage = StageRunner(loaded.model, loaded.part, slow, self.runner, tp=loaded.tp)
        self.stage.weight_bytes = loaded.weight_bytes
        self.stage.host_weights, self.stage.host_gbps = loaded.host_weights, stage.emulate_host_gbps
        self.stage.start_streaming(device)
        self.rss_before_load_bytes = loaded.rss_before_load_bytes

    # ---- running micro-batches --------------------------------------------------------------------
    def launch(self, micro: InFlightBatch, kv_copies: KvCopies) -> None:
        """Prepare the micro-batch, run it through stage 0's layers and send it along its path (or
        send its token ids to a path that starts elsewhere)."""
        input_ids, positions, meta, sample_rows = self.runner.prepare(micro.batch)
        path_index = self._path_of_slot[micro.slot]
        path = self.paths[path_index].ranks
        for seq_id in micro.seq_ids:
            self._path_of_seq[seq_id] = path_index
        sampled = micro.sampled
        message = BatchMessage(
            micro.batch_id,
            positions,
            meta,
            sample_rows,
            [(seq.seq_id, seq.params) for seq in sampled],
            self._take_released(path_index),
            [scoring for _, scoring in micro.scorings],
            {s.seq_id: self._resume.pop(s.seq_id) for s in sampled if s.seq_id in self._resume},
            kv_copies=kv_copies.copies,
            host_kv_blocks=kv_copies.host_blocks,
            path=path,
            fresh_stats=self._fresh_stats,
            token_bitmasks=[None if s.token_bitmask is None else s.token_bitmask.array() for s in sampled],
        )
        self._fresh_stats = False
        if path != (0,):  # before the send: the tokens may come back before this thread goes on
            self.comm.expect_tokens(micro.batch_id, path[-1])
        if self.overlaps and path[0] == 0 and not micro.batch.prefills:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, "tessel-stage0")
            micro.pending = self._queued = self._worker.submit(self._send_on, micro, message, input_ids)
            self.num_overlapped += 1
            return
        self._wait_for_worker()  # what was launched before leaves stage 0 first
        self._send_on(micro, message, input_ids)

    def _send_on(self, micro: InFlightBatch, message: BatchMessage, input_ids: torch.Tensor) -> None:
        """Stage 0's layers on the micro-batch and the send to the next stage (or its token ids to a
        path that starts elsewhere)."""
        try:
            if message.path[0] == 0:
                self._run_stage0(micro, message, input_ids)
            else:
                self.comm.send_batch(message, None, input_ids)
        except PeerLostError as error:
            raise self._lost(error) from error

    def _wait_for_worker(self) -> None:
        """Wait until the worker has sent every micro-batch given to it (its failure is raised by the
        `collect` of the micro-batch that failed)."""
        queued, self._queued = self._queued, None
        if queued is not None:
            self._wait(lambda: futures.wait([queued], timeout=WORKER_POLL_S).done)

    def _wait(self, done: Callable[[], object]) -> None:
        """Poll `done()` until it holds; a lost stage (`abort`, from its watcher) is raised instead,
        so a worker stuck on a link that will never answer does not hold the engine."""
        while not done():
            if self.failure is not None:
                raise self.failure

    def _run_stage0(self, micro: InFlightBatch, message: BatchMessage, input_ids: torch.Tensor) -> None:
        started, cpu_started, thread_started = time.perf_counter(), time.process_time(), time.thread_time()
        hidden = self.runner.run_stage(message.positions, message.meta, input_ids=input_ids)
        micro.compute_s = time.perf_counter() - started
        if message.path == (0,):  # stage 0 samples: a one-stage plan, or a flow path of rank 0 alone
            micro.result = self._result(micro, self.stage.sample(hidden, message))
        prefill = bool(micro.batch.prefills)
        self.stage.account(started, micro.batch.num_tokens, cpu_started, prefill, thread_started)
        if message.path != (0,):
            self.comm.send_batch(message, hidden)

    def ready(self, micro: InFlightBatch) -> bool:
        if micro.pending is not None and not micro.pending.done():
            return False
        return self.comm is not None and self.comm.tokens_ready(micro.batch_id)

    def collect(self, micro: InFlightBatch) -> StepResult:
        if micro.pending is not None:  # stage 0's part on the worker: sent (or raised) first
            pending, micro.pending = micro.pending, None
            self._wait(lambda: futures.wait([pending], timeout=WORKER_POLL_S).done)
            pending.result()
            if micro.result is not None:  # stage 0 sampled it (a path of rank 0 alone)
                return micro.result
        try:
            back = self.comm.recv_tokens(micro.batch_id, len(micro.sampled))
        except PeerLostError as error:
            raise self._lost(error) from error
        return self._result(micro, back)

    @staticmethod
    def _result(micro: InFlightBatch, back) -> StepResult:  # noqa: ANN001 (SampledRows)
        prompt = [
            (seq, scoring.first, logprobs)
            for (seq, scoring), logprobs in zip(micro.scorings, back.prompt_logprobs, strict=True)
        ]
        return StepResult(micro.sampled, back.tokens, back.logprobs, prompt)

    def _lost(self, error: PeerLostError) -> BaseException:
        """The failure behind a lost peer (the stage that died, when this process's children include
        it and it exits within `EXPLAIN_SETTLE_S`), kept as this executor's failure."""
        if self.failure is None:
            settle_s = getattr(self.stages, "explain_settle_s", EXPLAIN_SETTLE_S)
            found = self.stages.failure(settle_s=settle_s) if self.stages is not None else None
            self.failure = found or error
        return self.failure

    def abort(self, failure: BaseException) -> None:
        """A stage is lost (its watcher found it): the next step raises `failure`, and a wait for
        tokens it is blocked in now, which a cut link would never end by itself."""
        if self.failure is None:
            self.failure = failure
        if self.comm is not None:
            self.comm.abort(self.failure)

    def release(self, seq_ids: list[int]) -> None:
        """Finished sequences: their path's last stage drops their generators, told by the path's
        next micro-batch."""
        for seq_id in seq_ids:
            path = self._path_of_seq.pop(seq_id, None)
            if path is not None:
                self._released[path].append(seq_id)

    def _take_released(self, path: int) -> list[int]:
        taken, self._released[path] = self._released[path], []
        return taken

    def resume(self, seq_id: int, draws: int) -> None:
        self._resume[seq_id] = draws

    def count_from_here(self) -> None:
        """Start every stage's counts anew (after a warm-up): stage 0's now, the others' with the next
        micro-batch (`BatchMessage.fresh_stats`)."""
        self.stage.stats = StageStats()
        self._fresh_stats = True

    def chunk_sizes(self, num_tokens: int) -> list[int] | None:
        if self.cutter is None or not self.cutter.wants(num_tokens):
            return None
        sizes = self.cutter.chunks(num_tokens)
        self.stage.stats.cpp_prompts += 1
        self.stage.stats.cpp_chunks += len(sizes)
        return sizes

    # ---- the end ------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the pipeline: children are stopped (a supervised pipeline, whatever its state); stages
        someone else started are told to stop (after the last micro-batch). Then leave the group."""
        if self._worker is not None:  # after a loss, a worker blocked on a dead link is not waited for
            self._worker.shutdown(wait=self.failure is None, cancel_futures=True)
        if self._listener is not None:  # never joined
            self._listener.close()
            self._listener = None
        try:
            if self.comm is not None and self.stages is None:
                self.comm.close()  # every token owed is back: the receiver threads end
                self.comm.send_stop()
                self.comm.flush()
        finally:
            if self.stage is not None:
                self.stage.stop_tp()
            if self.stages is not None:
                self.stages.stop()
            if self.comm is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - a dead peer may make this fail too
                    pass
            self.comm = None
