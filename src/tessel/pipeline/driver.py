"""Stage 0 of a pipeline: the engine's scheduler, KV bookkeeping and sampling rules, run as a pipeline.

`PipelineEngine` is an `LLM` (so `generate`, `stream`, `add_request`, `step`, `abort_request`,
`has_unfinished_requests` are the engine's) whose model is stage 0's layers only. A step:

1. every idle in-flight slot (`PinnedSchedulers`) is scheduled by the engine's scheduler; its
   batch is prepared and run through stage 0's layers by the engine's `ModelRunner` (`prepare`:
   flat tokens, slot mapping, block tables; `run_stage`) and sent on with its metadata; a prefill
   whose remaining prompt is longer than the CPP threshold is sent instead as the chunks the CPP
   planner chose, one micro-batch each, back to back (chunk i needs only chunks < i, which every
   stage has already computed since stages take micro-batches in order);
2. the oldest micro-batch's sampled tokens, with the logprobs its requests asked for
   (`tessel.pipeline.sampled`), are received from the last stage and applied with the engine's own
   update (`LLMEngine._finish_step`: computed tokens, logprobs, prefix cache, stop rules). A thread
   takes tokens off the wire as they come (`tessel.pipeline.token_receiver`), so before each launch
   of step 1 the micro-batches whose tokens came back while stage 0 computed are applied first (their
   requests' tokens out, their slots free for this step); after the launches, the oldest still out
   is waited for.

Aborting a request whose micro-batch is in flight takes effect when that micro-batch is back.

Preemption (`tessel.engine.preemption`): stage 0 swaps or recomputes as one process does (its
emulated host link from the plan unless `emulate_host_gbps` is given; auto weighs its own layers'
KV bytes against its own prefill seconds). Every stage holds its own layers' KV blocks, so stage 0's
copies to and from its host pool travel with the next micro-batch (`BatchMessage.kv_copies`) and
each stage repeats them on its layers before computing it: stages take micro-batches in order, so
a block is copied out before a later batch reuses it and copied in before the batch that reads it.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessel.engine.llm_engine import LLM
from tessel.engine.model_runner import (
    PromptScoring,
    SampledRows,
    StepResult,
    kv_cache_bytes_per_block,
    prompt_scorings,
)
from tessel.engine.outputs import RequestOutput
from tessel.engine.preemption import Preemptor
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence
from tessel.errors import TesselError
from tessel.models.layer_filter import LayerFilter
from tessel.models.llama import LlamaForCausalLM
from tessel.models.loader import load_model
from tessel.models.quantized.load_quantize import quantize_layers
from tessel.pipeline.chunk_cutter import ChunkCutter
from tessel.pipeline.comm import BatchMessage, KvLayout, PeerLostError, StageComm, agree_kv_layout
from tessel.pipeline.devices import stage_device
from tessel.pipeline.pinned_schedulers import PinnedSchedulers
from tessel.pipeline.run_plan import RunPlan
from tessel.pipeline.stage import KvBudget, StageExecutor, StageStats, rss_bytes, tensor_bytes
from tessel.pipeline.weight_stream import host_copy


@dataclass(slots=True)
class _InFlight:
    batch_id: int
    slot: int
    apply: SchedulerOutput | None  # what to count when it is back (None: a CPP chunk before the last)
    sampled: list[Sequence]
    scorings: list[tuple[Sequence, PromptScoring]]  # chunks whose prompt logprobs come back
    result: SampledRows | None = None  # already sampled (single-stage pipelines)
    seq_ids: list[int] = field(default_factory=list)


def stage_kv_budget(plan: RunPlan, rank: int, kv_cache_gib: float | None) -> KvBudget:
    stage = plan.stages[rank]
    total = plan.num_layers or max(s.layer_end for s in plan.stages)
    return KvBudget(kv_cache_gib, stage.kv_gib, stage.num_layers / total)


def layer_filter(plan: RunPlan, rank: int, tied: bool) -> LayerFilter:
    stage = plan.stages[rank]
    last = rank == len(plan.stages) - 1
    embed = rank == 0
    if plan.paths:  # a flow plan's placements: a range from layer 0 embeds, one to the last layer samples
        embed, last = stage.layer_start == 0, stage.layer_end == max(s.layer_end for s in plan.stages)
    return LayerFilter(
        stage.layer_start,
        stage.layer_end,
        embed=embed,
        head=last,
        tied=tied,
        host_layers=frozenset(stage.offload_layers),  # streamed from host memory (weight_stream)
    )


class PipelineEngine(LLM):
    def __init__(
        self,
        model_path: str | Path,
        plan: RunPlan,
        comm: StageComm | None,
        *,
        micro_batches: int | None = None,
        cutter: ChunkCutter | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.plan, self.comm, self.cutter = plan, comm, cutter
        engine_kwargs.setdefault("device", stage_device(plan.stages[0]))  # the plan's, not --device
        if plan.stages[0].offload_layers:
            engine_kwargs["enforce_eager"] = True  # streamed layers are copied in by forward hooks
        if engine_kwargs.get("emulate_host_gbps") is None:
            engine_kwargs["emulate_host_gbps"] = getattr(plan.stages[0], "emulate_host_gbps", None)
        super().__init__(model_path, **engine_kwargs)
        self.scheduler = self._make_schedulers(micro_batches)
        num_slots = len(self.scheduler.slots)
        for slot in self.scheduler.slots:
            slot.preemptor = self.preemptor
        self.stage = StageExecutor(self.model, self._part, plan.stages[0].emulate_speed, self.runner)
        self.stage.emulate_schedule = plan.stages[0].emulate_schedule
        self.stage.publish_epoch = any(s.emulate_schedule for s in plan.stages)
        self.stage.weight_bytes = self._weight_bytes
        self.stage.host_weights, self.stage.host_gbps = self._host_weights, plan.stages[0].emulate_host_gbps
        self.stage.start_streaming(self.runner.device)
        self._in_flight: deque[_InFlight] = deque()
        self._busy = [0] * num_slots  # micro-batches in flight per slot
        self._seqs_in_flight: Counter[int] = Counter()
        self._deferred_aborts: set[str] = set()
        self._released: list[int] = []
        self._batch_ids = itertools.count()
        self._next_slot = 0
        self._fresh_stats = False  # the next micro-batch tells the other stages to count anew
        # seeded requests moved in from another pipeline (`tessel.pipeline.remap`): noise draws made
        self.resume_draws: dict[int, int] = {}
        self.failure: BaseException | None = None  # set by a watcher when a stage died
        self.explain_peer_lost: Callable[[PeerLostError], BaseException] | None = None

    def _make_schedulers(self, micro_batches: int | None) -> PinnedSchedulers:
        """One scheduler per in-flight slot (a flow plan's engine groups them by path)."""
        slots = micro_batches or self.plan.micro_batches
        return PinnedSchedulers(slots, self.scheduler.config, self.block_manager)

    def _load_model(self, path: Path) -> LlamaForCausalLM:
        self._part = layer_filter(self.plan, 0, self.model_config.tie_word_embeddings)
        self.rss_before_load_bytes = rss_bytes()
        model = load_model(path, self.dtype, self.config.device, layers=self._part)
        quantized = self.plan.stages[0].quantized_layers
        if quantized:
            quantize_layers(model, quantized, self.dtype)
        self._weight_bytes = tensor_bytes(model)
        # the streamed layers' host copy, taken before the runner packs them
        self._host_weights = host_copy(model, self._part) if self._part.host_layers else None
        return model

    def _kv_layer_share(self) -> float:
        """--host-kv-cache-gib is the whole pipeline's, as --kv-cache-gib: stage 0 sizes its pool by
        its layers' share, and every stage holds that many blocks of its own layers."""
        return stage_kv_budget(self.plan, 0, None).layer_share

    def _build_preemptor(self) -> Preemptor:
        preemptor = super()._build_preemptor()
        if len(self.plan.stages) > 1 and preemptor.pool is not None:
            preemptor.copies = []  # the other stages repeat them (BatchMessage.kv_copies)
        return preemptor

    def _num_kv_blocks(self) -> int:
        """Stage 0's KV blocks from its own budget (`KvBudget`); with other stages, the fewest any
        stage's budget holds (they all index the block tables stage 0 hands out)."""
        if self.config.num_kv_blocks is not None:
            return super()._num_kv_blocks()
        bs = self.config.block_size
        per_block = kv_cache_bytes_per_block(self.model, bs, self.dtype)
        blocks_per_seq = -(-self.max_model_len // bs)
        budget = stage_kv_budget(self.plan, 0, self.config.kv_cache_gib)
        blocks = budget.blocks(per_block, blocks_per_seq, self.config.max_num_seqs)
        if self.comm is not None:
            mine = KvLayout(
                blocks, bs, self.config.pack_cpu_linears, self.config.max_num_seqs, self.max_model_len
            )
            blocks = agree_kv_layout(blocks, mine).num_blocks
        if blocks < blocks_per_seq:
            raise TesselError(
                f"the pipeline's KV cache holds {blocks * bs} tokens ({blocks} blocks of {bs} in the "
                f"smallest stage's budget), fewer than max_model_len={self.max_model_len}; raise "
                "--kv-cache-gib or lower --max-model-len"
            )
        return blocks

    # ---- the engine interface ------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        # a known failure counts as work: the next step() raises it (a server then answers 503)
        return super().has_unfinished_requests() or bool(self._in_flight) or self.failure is not None

    def abort_request(self, request_id: str) -> None:
        seq = self._requests.get(request_id)
        if seq is not None and self._seqs_in_flight[seq.seq_id]:
            self._deferred_aborts.add(request_id)
            return
        super().abort_request(request_id)
        if seq is not None:
            self._released.append(seq.seq_id)

    def step(self) -> list[RequestOutput]:
        if self.failure is not None:
            raise self.failure
        try:
            outputs, self._pending = self._pending, []
            self._launch(outputs)
            if self._in_flight:
                outputs.extend(self._complete(self._in_flight.popleft()))
            return outputs
        except PeerLostError as error:
            self.failure = error if self.explain_peer_lost is None else self.explain_peer_lost(error)
            raise self.failure from error

    def count_from_here(self) -> None:
        """Start every stage's counts anew (after a warm-up): stage 0's now, the others' with the
        next micro-batch (`BatchMessage.fresh_stats`)."""
        self.stage.stats = StageStats()
        self._fresh_stats = True

    def shutdown(self) -> None:
        """Finish what is in flight and tell the other stages to stop."""
        while self._in_flight:
            self._complete(self._in_flight.popleft())
        if self.comm is not None:
            self.comm.close()
            self.comm.send_stop()
            self.comm.flush()

    # ---- launching micro-batches -----------------------------------------------------------------
    def _launch(self, outputs: list[RequestOutput]) -> None:
        """A micro-batch on every idle slot, in turn from the slot after the last launched; before
        each, the micro-batches whose tokens came back while stage 0 computed are completed (into
        `outputs`), and a slot that frees is launched in the same pass (each slot once a step)."""
        slots = len(self._busy)
        launched: set[int] = set()
        nothing_to_run: set[int] = set()  # idle slots whose scheduler had no work
        while True:
            if self._take_arrived(outputs):
                nothing_to_run.clear()  # finished requests free blocks and slots
            slot = self._idle_slot(launched | nothing_to_run)
            if slot is None:
                return
            batch = self.scheduler.schedule(slot)
            if batch.is_empty:
                nothing_to_run.add(slot)
                continue
            launched.add(slot)
            self._next_slot = (slot + 1) % slots
            cut = [(seq, n) for seq, n in batch.prefills if self._cut(seq)]
            normal = SchedulerOutput(batch.decodes, [p for p in batch.prefills if p not in cut])
            if not normal.is_empty:
                self._send(slot, normal, normal)
            for seq, _ in cut:
                self._send_chunks(slot, seq)

    def _idle_slot(self, skip: set[int]) -> int | None:
        """The first idle slot from the one after the last launched, `skip` left out."""
        slots = len(self._busy)
        turn = ((self._next_slot + k) % slots for k in range(slots))
        return next((slot for slot in turn if not self._busy[slot] and slot not in skip), None)

    def _take_arrived(self, outputs: list[RequestOutput]) -> bool:
        """Complete the oldest micro-batches while the last stage's tokens for them are already here
        -> any completed. (Tokens sampled here, by a one-stage plan, wait for the step's end.)"""
        taken = False
        while self._in_flight and self._in_flight[0].result is None and self.comm.tokens_ready():
            outputs.extend(self._complete(self._in_flight.popleft()))
            taken = True
        return taken

    def _cut(self, seq: Sequence) -> bool:
        return self.cutter is not None and self.cutter.wants(len(seq) - seq.num_computed_tokens)

    def _send_chunks(self, slot: int, seq: Sequence) -> None:
        start = seq.num_computed_tokens
        total = len(seq) - start
        sizes = self.cutter.chunks(total)
        self.stage.stats.cpp_prompts += 1
        self.stage.stats.cpp_chunks += len(sizes)
        done = 0
        for index, size in enumerate(sizes):
            seq.num_computed_tokens = start + done  # where this chunk starts, for `prepare`
            last = index == len(sizes) - 1
            apply = SchedulerOutput(prefills=[(seq, total)]) if last else None
            self._send(slot, SchedulerOutput(prefills=[(seq, size)]), apply)
            done += size
        seq.num_computed_tokens = start  # counted when the last chunk is back

    def _send(self, slot: int, batch: SchedulerOutput, apply: SchedulerOutput | None) -> None:
        input_ids, positions, meta, sample_rows = self.runner.prepare(batch)
        sampled = [seq for seq, n in batch.scheduled() if seq.num_computed_tokens + n == len(seq)]
        scorings = prompt_scorings(batch)
        message = BatchMessage(
            next(self._batch_ids),
            positions,
            meta,
            sample_rows,
            [(seq.seq_id, seq.params) for seq in sampled],
            self._released,
            [scoring for _, scoring in scorings],
            {s.seq_id: self.resume_draws.pop(s.seq_id) for s in sampled if s.seq_id in self.resume_draws},
            kv_copies=self.preemptor.take_copies(),
            host_kv_blocks=self.preemptor.pool.num_total_blocks if self.preemptor.pool is not None else 0,
            fresh_stats=self._fresh_stats,
        )
        self._released, self._fresh_stats = [], False
        started, cpu_started = time.perf_counter(), time.process_time()
        hidden = self.runner.run_stage(positions, meta, input_ids=input_ids)
        if batch.prefills:  # what recomputing a context costs on this stage (tessel.engine.preemption)
            self.preemptor.clock.record(batch.num_tokens, time.perf_counter() - started)
        seq_ids = [s.seq_id for s, _ in batch.scheduled()]
        record = _InFlight(message.batch_id, slot, apply, sampled, scorings, seq_ids=seq_ids)
        if self.comm is None:
            record.result = self.stage.sample(hidden, message)
        self.stage.account(started, batch.num_tokens, cpu_started)
        if self.comm is not None:
            self.comm.send_batch(message, hidden)
            self.comm.expect_tokens(len(sampled))
        self._in_flight.append(record)
        self._busy[slot] += 1
        self._seqs_in_flight.update(record.seq_ids)

    # ---- results -------------------------------------------------------------------------------
    def _complete(self, record: _InFlight) -> list[RequestOutput]:
        back = record.result
        if back is None:
            back = self.comm.recv_tokens(record.batch_id, len(record.sampled))
        self._busy[record.slot] -= 1
        self._seqs_in_flight.subtract(record.seq_ids)
        prompt = [
            (seq, scoring.first, logprobs)
            for (seq, scoring), logprobs in zip(record.scorings, back.prompt_logprobs, strict=True)
        ]
        outputs = []
        if record.apply is None:  # a CPP chunk before the last: only its prompt logprobs to keep
            for seq, first, logprobs in prompt:
                seq.prompt_logprobs[first : first + len(logprobs)] = logprobs
        else:
            result = StepResult(record.sampled, back.tokens, back.logprobs, prompt)
            outputs = self._finish_step(record.apply, result, [])
            self._released.extend(seq.seq_id for seq, _ in record.apply.scheduled() if seq.is_finished)
        for request_id in list(self._deferred_aborts):
            seq = self._requests.get(request_id)
            if seq is None or not self._seqs_in_flight[seq.seq_id]:
                self._deferred_aborts.discard(request_id)
                self.abort_request(request_id)
        return outputs
