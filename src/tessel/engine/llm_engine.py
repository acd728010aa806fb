"""The engine loop (`LLMEngine`: add_request / step / abort_request) and the `LLM` front end.

`LLMEngine` owns the requests, their scheduling and their outputs; an executor
(`tessel.engine.executor`) runs what it schedules: the whole model in this process
(`LocalExecutor`, the default) or a plan's pipeline stages (`tessel.pipeline.executor`). A step:

1. every idle in-flight slot (`tessel.engine.slots`: one for one process, several for a pipeline)
   is scheduled by the engine's scheduler and its micro-batch launched on the executor; a prefill
   the executor wants cut into pipeline chunks (CPP, `Executor.chunk_sizes`) is launched as those
   chunks, back to back (chunk i needs only chunks < i, which every stage computes first). Before
   each launch the micro-batches whose tokens are already back are applied (their requests' tokens
   out, their slots free for this step);
2. the oldest micro-batch still out is waited for and applied: computed tokens counted, sampled
   tokens appended, logprobs kept, the prefix cache fed, the stop rules (EOS, stop token ids, stop
   strings, max_tokens, max_model_len) applied. `step()` returns one `RequestOutput` per request
   that changed. `LLM.generate` drives it to completion; `LLM.stream` yields one request's outputs.

With one process and one slot this is: schedule, run, apply. Aborting a request whose micro-batch
is in flight takes effect when that micro-batch is back.

One bad request never takes the others down: requests are validated when added, and when a
batched step raises, the executor bisects the batch (`tessel.engine.executor.run_isolated`) until
the failing request is found; it finishes with `finish_reason="error"` (its `RequestOutput.error`
holds the exception) and the others get their tokens. Only a failure that every request of a
multi-request batch hits alone (the model, not a request) escapes `step()`; `reset()` then fails
everything in flight. A lost pipeline stage escapes `step()` too, unless a supervisor stands behind
the engine (`tessel serve --plan`, `tessel.pipeline.supervision.supervisor`): it then builds a new
executor and `replace_executor` moves the unfinished requests into it, to be recomputed there.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceABC
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tessel.engine.block_manager import BlockManager, PathBlockManagers
from tessel.engine.detokenizer import IncrementalDetokenizer
from tessel.engine.engine_config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from tessel.engine.executor import (
    EngineSetup,
    Executor,
    ExecutorLayout,
    InFlightBatch,
    KvCopies,
    LocalExecutor,
)
from tessel.engine.guided.decoder import GRAMMAR_DEAD_END, GuidedDecoder
from tessel.engine.host_kv_pool import HostKvPool
from tessel.engine.memory import available_memory_bytes, check_host_kv_cache_fits, check_kv_cache_fits
from tessel.engine.model_runner import ModelRunner, StepResult, kv_cache_bytes_per_block
from tessel.engine.outputs import RequestOutput
from tessel.engine.preemption import PreemptionStats, Preemptor, host_pool_blocks, measure_host_link
from tessel.engine.run_ahead import ahead_seqs, fill_tokens, live_rows, prepare_ahead
from tessel.engine.sampling_params import SamplingParams
from tessel.engine.scheduler import SchedulerConfig, SchedulerOutput
from tessel.engine.sequence import RequestMetrics, Sequence, SequenceStatus
from tessel.engine.slots import SlotSchedulers
from tessel.errors import TesselError
from tessel.layers.linear.tuning import tune_linears
from tessel.models.config import ModelConfig, resolve_dtype
from tessel.models.gguf import resolve_model_path
from tessel.models.llama import LlamaForCausalLM
from tessel.text import check_text

__all__ = ["LLM", "LLMEngine", "RequestMetrics", "RequestOutput", "SamplingParams"]


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as error:
        raise TesselError(f"cannot load the tokenizer from {path}: {error}") from error


def max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest prompt + completion the engine takes: `config.max_model_len`, checked against the
    model (or the model's own limit when None)."""
    c = model_config
    limit = c.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise TesselError(
            f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={limit}"
        )
    return config.max_model_len


def max_num_batched_tokens(config: EngineConfig, max_len: int) -> int:
    """The step's token budget: `max_num_batched_tokens`, or the default (at least max_model_len
    without chunked prefill)."""
    tokens = config.max_num_batched_tokens
    if tokens is None:
        tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        return tokens if config.enable_chunked_prefill else max(tokens, max_len)
    if not config.enable_chunked_prefill and tokens < max_len:
        raise TesselError(
            f"max_num_batched_tokens={tokens} < max_model_len={max_len} needs chunked "
            "prefill; enable it or raise max_num_batched_tokens"
        )
    return tokens


def default_executor(config: EngineConfig) -> Executor:
    """The executor of an engine given none: the whole model here, or split over
    `tensor_parallel_size` ranks (`tessel.parallel`)."""
    if config.tensor_parallel_size > 1:
        from tessel.parallel.executor import TensorParallelExecutor

        return TensorParallelExecutor(config.tensor_parallel_size)
    return LocalExecutor(overlap=config.async_scheduling)


class LLMEngine:
    def __init__(self, model_path: str | Path, executor: Executor | None = None, **kwargs: Any) -> None:
        self._user_config = EngineConfig(**kwargs)  # as given: each executor adapts it (`configure`)
        self.executor: Executor = executor if executor is not None else default_executor(self._user_config)
        self.config = self.executor.configure(self._user_config)
        if self.config.async_scheduling and not self.executor.overlaps:
            raise TesselError(
                f"async_scheduling runs on one process's executor or a plan's stage 0; "
                f"{type(self.executor).__name__} does not overlap its steps yet"
            )
        if self.config.kv_cache_gib is not None:
            check_kv_cache_fits(self.config.kv_cache_gib, self.config.device)
        if self.config.host_kv_cache_gib is not None and self.config.preemption_mode != "recompute":
            check_host_kv_cache_fits(self.config.host_kv_cache_gib)
        path = resolve_model_path(model_path)  # a .gguf file becomes a checkpoint directory
        if not path.is_dir():
            raise TesselError(
                f"model directory {path} does not exist; pass a local Hugging Face model directory"
            )
        self.model_name = path.resolve().name
        self.model_config = ModelConfig.from_dir(path)
        self.dtype = resolve_dtype(self.config.dtype, self.model_config)
        self.max_model_len = max_model_len(self.config, self.model_config)
        self.tokenizer = load_tokenizer(path)
        self.model_path = path
        self.setup = EngineSetup(path, self.config, self.model_config, self.dtype, self.max_model_len)
        self.preemption_stats = PreemptionStats()  # by mode, since the engine started (every executor)
        self._schedule_on(self.executor.start(self.setup))
        eos = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        on_gpu = str(self.config.device).startswith("cuda")  # masks overlap the forward only off the host
        vocab = self.model_config.vocab_size
        self.guided = GuidedDecoder(self.tokenizer, vocab, self.eos_token_ids, overlap=on_gpu)
        self._requests: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborts, returned by the next step()
        self._batch_ids = itertools.count()
        self._deferred_aborts: set[str] = set()
        self.supervisor: Any = None  # a pipeline's supervisor steps the engine (`step`) when set
        self.wake: Callable[[], object] | None = None  # the thread that steps it, woken (a server sets it)
        self.num_steps_ahead = 0  # decode steps launched before the last one's tokens were applied

    def _schedule_on(self, layout: ExecutorLayout) -> None:
        """The block manager, the slots' schedulers and the preemption policy for `layout`; nothing in
        flight."""
        config = self.config
        if layout.block_ranges is None:
            self.block_manager = BlockManager(
                layout.num_blocks,
                config.block_size,
                config.enable_prefix_caching,
                self.model_config.kv_window,
            )
        else:
            self.block_manager = PathBlockManagers(layout.block_ranges, config.block_size)
        budget = max_num_batched_tokens(config, self.max_model_len)
        scheduler_config = SchedulerConfig(config.max_num_seqs, budget, config.enable_chunked_prefill)
        self.scheduler = SlotSchedulers(layout.paths, scheduler_config, self.block_manager)
        self.preemptor = self._build_preemptor(layout)
        for slot in self.scheduler.slots:
            slot.preemptor = self.preemptor
        self._in_flight: deque[InFlightBatch] = deque()
        self._busy = [0] * len(self.scheduler.slots)  # micro-batches in flight per slot
        self._next_slot = 0

    def _build_preemptor(self, layout: ExecutorLayout) -> Preemptor:
        """The preemption policy; with swapping possible, a host pool on stage 0's KV cache and a
        measured host link."""
        config = self.config
        if config.preemption_mode == "swap" and layout.swap_refused is not None:
            raise TesselError(layout.swap_refused)
        if config.preemption_mode == "recompute" or layout.swap_refused is not None:
            return Preemptor("recompute", self.block_manager, stats=self.preemption_stats)
        per_block = kv_cache_bytes_per_block(self.model, config.block_size, self.dtype)
        device_blocks, host_bytes = self.block_manager.num_total_blocks, available_memory_bytes()
        blocks = host_pool_blocks(
            config.host_kv_cache_gib, per_block, device_blocks, host_bytes, layout.kv_layer_share
        )
        pool = HostKvPool(blocks, layout.kv_cache, config.emulate_host_gbps)
        link = measure_host_link(layout.kv_cache.device, config.emulate_host_gbps)
        preemptor = Preemptor(
            config.preemption_mode, self.block_manager, pool, link, stats=self.preemption_stats
        )
        if layout.records_kv_copies:
            preemptor.copies = []  # the other stages repeat them (`KvCopies`)
        return preemptor

    # ---- what the executor runs ------------------------------------------------------------------
    @property
    def runner(self) -> ModelRunner:
        """Stage 0's model runner (the whole model's for one process)."""
        return self.executor.runner

    @property
    def model(self) -> LlamaForCausalLM:
        return self.executor.model

    # ---- sizing -------------------------------------------------------------------------------
    def _max_num_batched_tokens(self) -> int:
        return max_num_batched_tokens(self.config, self.max_model_len)

    # ---- requests -----------------------------------------------------------------------------
    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_total_blocks

    def warm_up(self) -> bool:
        """Build the decode step's graphs now, so the first requests do not wait for them; -> whether
        the engine has any. On CUDA: tune the linears' GEMM tiles for every row bucket a step can
        have (`tessel.layers.linear.tuning.tune_linears`, up to max_num_batched_tokens rows), then
        capture every bucket of rows (`tessel.engine.cuda_graph`, on dummy rows). On CPU, in one
        process: one decode step per bucket of rows the compiled graph takes
        (`StepPlan.warm_up_rows`: one row where the linears have one-row forms, with its first
        attention bucket; every bucket up to `max_num_seqs` where some linear is split), each row a
        two-token dummy sequence on a block freed afterwards, outside the scheduler and the prefix
        cache. A one-row step's longer attention buckets (the graphs', not the native step's)
        compile when a context first reaches them (docs/engine.md). A pipeline's CPU stages
        compile as their steps come."""
        plan = self.runner.plan
        if plan.cuda_graphs is not None:
            tune_linears(self.model, self._max_num_batched_tokens(), self.dtype)
            return plan.cuda_graphs.capture_all()
        rows = plan.warm_up_rows(self.config.max_num_seqs)
        if not rows or not isinstance(self.executor, LocalExecutor):
            return False
        params = SamplingParams(temperature=0, max_tokens=1)
        seq = Sequence("warm-up", [0, 0], params, self.config.block_size)
        self.block_manager.allocate(seq, 0)
        try:
            self.runner.run(SchedulerOutput(prefills=[(seq, 1)]))
            seq.num_computed_tokens = 1
            for n in rows:  # n rows of the one sequence: each writes the same k/v into the same slot
                self.runner.run(SchedulerOutput(decodes=[seq] * n))
        finally:
            self.block_manager.free(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        # a known failure counts as work: the next step() raises it (a server then answers 503), and
        # a supervisor with something to do (a remap to switch to) gets its step
        return (
            self.scheduler.num_unfinished > 0
            or bool(self._pending)
            or bool(self._in_flight)
            or self.executor.failure is not None
            or (self.supervisor is not None and self.supervisor.has_work())
        )

    def tokenize(self, prompt: str | list[int], tokenizer: Any = None) -> list[int]:
        """Token ids of a text prompt, or token ids checked against the vocabulary.

        `tokenizer`: a copy of `self.tokenizer` to use instead (the server tokenizes on other threads).
        """
        if isinstance(prompt, str):
            tokenizer = tokenizer or self.tokenizer
            ids = list(tokenizer(check_text(prompt, "the prompt"))["input_ids"])
        else:
            ids = self.check_token_ids(prompt)
        if not ids:
            raise TesselError("the prompt is empty; give at least one token")
        return ids

    def check_token_ids(self, prompt: SequenceABC[int]) -> list[int]:
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str | bytes) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise TesselError("a prompt given as token ids must be a list of integers")
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            shown = [t if abs(t) < 10**12 else "..." for t in bad[:5]]
            raise TesselError(f"prompt token ids {shown} are outside the vocabulary [0, {vocab})")
        return ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request; `prompt_token_ids` (already tokenized elsewhere) skips tokenizing `prompt`."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TesselError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.verify(self.model_config.vocab_size)
        if request_id in self._requests:
            raise TesselError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt) if prompt_token_ids is None else self.tokenize(prompt_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if max_tokens < 1 or len(ids) + max_tokens > self.max_model_len:
            raise TesselError(
                f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: {len(ids) + max_tokens} > "
                f"max_model_len={self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        text = prompt if isinstance(prompt, str) else None
        seq = Sequence(request_id, ids, params, self.config.block_size, prompt=text, max_tokens=max_tokens)
        self._requests[request_id] = seq
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, ids, params.stop, params.skip_special_tokens, may_defer=True
        )
        if params.guided is not None:
            try:
                self.guided.start(seq.seq_id, params.guided)
            except BaseException:
                del self._requests[request_id], self._detokenizers[request_id]
                raise
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; the next `step()` reports it as "abort". A
        request in a micro-batch in flight stops when that micro-batch is back."""
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return
        if self._in_flight_now(seq):
            self._deferred_aborts.add(request_id)
            return
        self.scheduler.finish(seq, "abort")
        self._detokenizers[request_id].finish()
        self._pending.append(self._output(seq, []))
        self.executor.release([seq.seq_id])

    def reset(self, error: BaseException) -> list[RequestOutput]:
        """Finish every unfinished request with `error` (after a step failed for all of them)."""
        outputs, self._pending = self._pending, []
        for seq in list(self._requests.values()):
            if not seq.is_finished:
                outputs.append(self._fail(seq, error))
        return outputs

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.supervisor is not None:
            return self.supervisor.step(self)
        return self.run_step()

    def run_step(self) -> list[RequestOutput]:
        """One step on the executor (what `step` runs; a supervisor runs it inside its recovery)."""
        failure = self.executor.failure
        if failure is not None:
            raise failure
        outputs, self._pending = self._pending, []
        try:
            if self._in_flight and self.executor.runs_ahead and self._step_ahead(outputs):
                return outputs
            self._launch(outputs)
            if self._in_flight and not self._leave_in_flight():
                outputs.extend(self._complete(self._in_flight.popleft()))
        except BaseException:
            self._pending = outputs + self._pending  # what was applied still reaches its streams
            raise
        return outputs

    def drain_pending(self) -> list[RequestOutput]:
        """The outputs waiting for the next step (aborts, a failed step's), now."""
        outputs, self._pending = self._pending, []
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Finish the micro-batches in flight without launching more; -> their outputs."""
        outputs, self._pending = self._pending, []
        while self._in_flight:
            outputs.extend(self._complete(self._in_flight.popleft()))
        return outputs

    def shutdown(self) -> None:
        """Finish what is in flight and stop the executor."""
        while self._in_flight:
            self._complete(self._in_flight.popleft())
        self.executor.shutdown()
        self.guided.shutdown()

    def count_from_here(self) -> None:
        """Start the executor's counts anew (after a warm-up)."""
        self.executor.count_from_here()

    # ---- async scheduling (tessel.engine.run_ahead) ----------------------------------------------
    def _step_ahead(self, outputs: list[RequestOutput]) -> bool:
        """With the decode step in flight: prepare the next one for the same sequences, wait for this
        one's tokens, launch the next with them, then apply them (into `outputs`); -> False, with
        nothing changed but blocks reserved, where the engine may not run ahead (it then completes
        the step and schedules as usual)."""
        micro = self._in_flight[0]
        seqs = ahead_seqs(self, micro) if micro.result is None else None  # collected: nothing to overlap
        if seqs is None:
            return False
        prepared = prepare_ahead(self.runner, seqs, self.block_manager.reserve)
        result = self.executor.collect(micro)  # the wait
        if micro.failed or not fill_tokens(prepared, seqs, result):
            return False
        batch = SchedulerOutput(seqs)
        ahead = InFlightBatch(next(self._batch_ids), micro.slot, batch, batch, seqs, [], ahead=True)
        self.executor.launch_prepared(ahead, prepared)
        self._in_flight.popleft()
        self._in_flight.append(ahead)
        self._busy[ahead.slot] += 1
        self.num_steps_ahead += 1
        outputs.extend(self._complete(micro))
        return True

    def _leave_in_flight(self) -> bool:
        """Whether the step just launched is left computing (the next step() runs ahead of it)."""
        micro = self._in_flight[0]
        return self.executor.runs_ahead and micro.result is None and ahead_seqs(self, micro) is not None

    # ---- launching micro-batches -----------------------------------------------------------------
    def _launch(self, outputs: list[RequestOutput]) -> None:
        """A micro-batch on every idle slot, in turn from the slot after the last launched; before
        each, the micro-batches whose tokens came back meanwhile are completed (into `outputs`), and a
        slot that frees is launched in the same pass (each slot once a step)."""
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
            cut = [(seq, sizes) for seq, n in batch.prefills if (sizes := self._chunks(seq))]
            cut_seqs = {id(seq) for seq, _ in cut}
            normal = SchedulerOutput(batch.decodes, [p for p in batch.prefills if id(p[0]) not in cut_seqs])
            if not normal.is_empty:
                self._send(slot, normal, normal)
            for seq, sizes in cut:
                self._send_chunks(slot, seq, sizes)

    def _in_flight_now(self, seq: Sequence) -> bool:
        """Whether a micro-batch still out holds `seq` (looked up when a request is aborted: nothing
        is counted per step)."""
        return any(seq.seq_id in micro.seq_ids for micro in self._in_flight)

    def _idle_slot(self, skip: set[int]) -> int | None:
        """The first idle slot from the one after the last launched, `skip` left out."""
        slots = len(self._busy)
        turn = ((self._next_slot + k) % slots for k in range(slots))
        return next((slot for slot in turn if not self._busy[slot] and slot not in skip), None)

    def _take_arrived(self, outputs: list[RequestOutput]) -> bool:
        """Complete the oldest micro-batches while their tokens are already here -> any completed.
        (One computed in this process, by a one-stage executor, waits for the step's end.)"""
        taken = False
        while (
            self._in_flight and self._in_flight[0].result is None and self.executor.ready(self._in_flight[0])
        ):
            outputs.extend(self._complete(self._in_flight.popleft()))
            taken = True
        return taken

    def _arrived(self, micro: InFlightBatch) -> bool:
        return micro.result is None and self.executor.ready(micro)

    def _chunks(self, seq: Sequence) -> list[int] | None:
        """The CPP chunks the executor cuts `seq`'s remaining prompt into (None: not cut)."""
        return self.executor.chunk_sizes(len(seq) - seq.num_computed_tokens)

    def _send_chunks(self, slot: int, seq: Sequence, sizes: list[int]) -> None:
        start = seq.num_computed_tokens
        total = sum(sizes)
        done = 0
        for index, size in enumerate(sizes):
            seq.num_computed_tokens = start + done  # where this chunk starts, for `prepare`
            last = index == len(sizes) - 1
            apply = SchedulerOutput(prefills=[(seq, total)]) if last else None
            self._send(slot, SchedulerOutput(prefills=[(seq, size)]), apply)
            done += size
        seq.num_computed_tokens = start  # counted when the last chunk is back

    def _send(self, slot: int, batch: SchedulerOutput, apply: SchedulerOutput | None) -> None:
        micro = InFlightBatch.of(next(self._batch_ids), slot, batch, apply)
        self._start_masks(micro.sampled)
        pool = self.preemptor.pool
        copies = KvCopies(self.preemptor.take_copies(), pool.num_total_blocks if pool is not None else 0)
        self.executor.launch(micro, copies)
        if batch.prefills and not micro.failed:  # what recomputing a context costs (tessel.engine.preemption)
            self.preemptor.clock.record(batch.num_tokens, micro.compute_s)
        self._in_flight.append(micro)
        self._busy[slot] += 1

    def _start_masks(self, sampled: list[Sequence]) -> None:
        """Start computing the allowed tokens of the guided sequences about to sample (on a worker
        thread, while the forward runs; the sampler waits for them)."""
        if not self.guided.active:
            return
        guided = [seq for seq in sampled if self.guided.guides(seq.seq_id)]
        if guided:
            for seq, row in zip(guided, self.guided.masks([seq.seq_id for seq in guided]), strict=True):
                seq.token_bitmask = row

    # ---- results -------------------------------------------------------------------------------
    def _complete(self, micro: InFlightBatch) -> list[RequestOutput]:
        result = micro.result if micro.result is not None else self.executor.collect(micro)
        self._busy[micro.slot] -= 1
        outputs: list[RequestOutput] = []
        if micro.apply is None:  # a CPP chunk before the last: only its prompt logprobs to keep
            for seq, first, logprobs in result.prompt_logprobs:
                seq.prompt_logprobs[first : first + len(logprobs)] = logprobs
        else:
            failed = micro.failed
            if micro.ahead:  # rows of requests that finished on the token before: dropped
                result, micro.apply = live_rows(result, micro.apply)
                failed = [(seq, error) for seq, error in failed if seq.status is SequenceStatus.RUNNING]
            if failed and not result.seqs and len(failed) > 1:
                raise failed[0][1]  # every request failed on its own: the engine, not a request
            outputs = self._finish_step(micro.apply, result, failed)
            done, apply = SequenceStatus.FINISHED, micro.apply
            finished = [seq.seq_id for seq in apply.decodes if seq.status is done]
            if apply.prefills:
                finished += [seq.seq_id for seq, _ in apply.prefills if seq.status is done]
            if finished:
                self.executor.release(finished)
        for request_id in list(self._deferred_aborts):
            seq = self._requests.get(request_id)
            if seq is None or not self._in_flight_now(seq):
                self._deferred_aborts.discard(request_id)
                self.abort_request(request_id)
        return outputs

    def _finish_step(
        self, batch: SchedulerOutput, result: StepResult, failed: list[tuple[Sequence, Exception]]
    ) -> list[RequestOutput]:
        """Count the step's computed tokens, append the sampled ones, apply the stop rules."""
        outputs = [self._fail(seq, error) for seq, error in failed]
        self.block_manager.commit_computed(_count_computed(batch, failed))
        for seq, first, logprobs in result.prompt_logprobs:
            seq.prompt_logprobs[first : first + len(logprobs)] = logprobs
        now = time.time()
        guided = self.guided.active
        if self.bulk and not guided:
            outputs += self._apply_tokens(result, now)
            return outputs
        for seq, token, logprobs in zip(result.seqs, result.tokens, result.logprobs, strict=True):
            if logprobs is not None:
                seq.logprobs.append(logprobs)
            if guided:
                seq.token_bitmask = None
                if not self.guided.accept(seq.seq_id, token):  # its grammar allowed no token at all
                    outputs.append(self._end(seq, GRAMMAR_DEAD_END))
                    continue
            outputs.append(self._apply_token(seq, token, now))
        return outputs

    def _apply_token(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        """`seq`'s sampled `token` appended, its stop rules applied; -> its output."""
        try:
            self._append(seq, token, now)
        except Exception as error:  # e.g. a token the tokenizer cannot decode
            return self._fail(seq, error)
        return self._output(seq, [token])

    # tests turn the bulk path off to hold it against the per-request one
    bulk = True

    def _apply_tokens(self, result: StepResult, now: float) -> list[RequestOutput]:
        """The step's tokens applied, no request guided: `_apply_token` for each, inlined for a
        request whose detokenizer is deferred (no stop strings): its stop rules are token rules, and
        an unfinished one's output is built here with nothing looked up twice. Run once per request
        per step: every attribute read counts."""
        outputs = []
        detokenizers, eos, max_len = self._detokenizers, self.eos_token_ids, self.max_model_len
        finished, unfinished = SequenceStatus.FINISHED, RequestOutput.unfinished
        for seq, token, logprobs in zip(result.seqs, result.tokens, result.logprobs, strict=True):
            if logprobs is not None:
                seq.logprobs.append(logprobs)
            detok = detokenizers[seq.request_id]
            if not detok.deferred:
                outputs.append(self._apply_token(seq, token, now))
                continue
            token_ids = seq.token_ids
            token_ids.append(token)
            if seq.metrics.first_token_time is None:
                seq.metrics = seq.metrics.but(first_token_time=now)
            params = seq.params
            num_output = len(token_ids) - seq.num_prompt_tokens
            if _stop_token(params, token, eos):
                detok.finish()
                self.scheduler.finish(seq, "stop")
            elif _at_length(seq, max_len):
                detok.finish()
                self.scheduler.finish(seq, "length")
            if seq.status is finished or params.logprobs is not None or params.prompt_logprobs is not None:
                outputs.append(self._output(seq, [token]))
                continue
            previous, detok.emitted_tokens = detok.emitted_tokens, num_output
            outputs.append(
                unfinished(
                    seq.request_id,
                    seq.prompt_token_ids,
                    [token],
                    seq.num_prompt_tokens,
                    num_output,
                    seq.metrics,
                    seq.prompt,
                    token_ids,
                    detok,
                    previous,
                )
            )
        return outputs

    def _fail(self, seq: Sequence, error: BaseException) -> RequestOutput:
        seq.error = error
        return self._end(seq, "error")

    def _end(self, seq: Sequence, reason: str) -> RequestOutput:
        self.scheduler.finish(seq, reason)
        self._detokenizers[seq.request_id].finish()
        return self._output(seq, [])

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        token_ids = seq.token_ids
        token_ids.append(token)
        if seq.metrics.first_token_time is None:
            seq.metrics = seq.metrics.but(first_token_time=now)
        params, detok = seq.params, self._detokenizers[seq.request_id]
        reason = None
        if _stop_token(params, token, self.eos_token_ids):
            reason = "stop"
        elif not detok.deferred and detok.add_token(token) is not None:  # deferred: decoded when read
            reason = "stop"
        elif _at_length(seq, self.max_model_len):
            reason = "length"
        elif self.guided.active and self.guided.finished(seq.seq_id):  # its grammar takes nothing more
            reason = "stop"
        if reason is not None:
            detok.finish()
            self.scheduler.finish(seq, reason)

    def _output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        """The request's output now: its token ids and, for a deferred detokenizer, its text are built
        when first read (`RequestOutput.later`)."""
        rid = seq.request_id
        detok = self._detokenizers[rid]
        num_output_tokens = len(seq.token_ids) - seq.num_prompt_tokens
        if detok.deferred:
            text = new_text = None
            previous, detok.emitted_tokens = detok.emitted_tokens, num_output_tokens
        else:
            text, emitted, previous = detok.text, detok.emitted_chars, 0
            new_text = text[emitted:] if len(text) > emitted else ""
            detok.emitted_chars = len(text)
        finished = seq.status is SequenceStatus.FINISHED
        if finished:
            del self._requests[rid], self._detokenizers[rid]
            self.guided.release(seq.seq_id)
        params = seq.params
        output = RequestOutput(
            rid,
            seq.prompt_token_ids,
            None,
            new_token_ids,
            text,
            new_text,
            finished,
            seq.finish_reason,
            seq.num_prompt_tokens,
            num_output_tokens,
            seq.metrics,
            seq.prompt,
            seq.error,
            list(seq.logprobs) if params.logprobs is not None else None,
            list(seq.prompt_logprobs) if params.prompt_logprobs is not None else None,
        )
        return output.later(seq.token_ids, detok if detok.deferred else None, previous)

    # ---- another executor ------------------------------------------------------------------------
    def setup_for(self, executor: Executor) -> EngineSetup:
        """What `executor` is started from: the engine's settings as it adapts them."""
        config = executor.configure(self._user_config)
        return EngineSetup(self.model_path, config, self.model_config, self.dtype, self.max_model_len)

    def replace_executor(self, executor: Executor, layout: ExecutorLayout) -> list[str]:
        """Serve from `executor` (started, with `layout`) from now on: the old executor's micro-batches
        in flight are dropped (`drain` first to keep them), its requests move to the new one in
        arrival order, to be recomputed there; -> the request ids moved. The old executor is the
        caller's to shut down.

        Each request keeps its prompt, the tokens generated so far, its sampling parameters, its
        remaining max_tokens, its stop rules and detokenizer, its logprobs and its metrics; its KV
        is rebuilt by recomputation (the preemption path). A seeded sampled request's generator
        lives on the last stage: the new executor fast-forwards one past the draws its tokens so far
        consumed (`Executor.resume`), so its outputs continue as an undisturbed run would. Requests
        aborted while in flight are finished as aborted (their outputs come with the next step)."""
        moved = []
        waiting = [seq for seq in self._requests.values() if not seq.is_finished]
        for seq in waiting:
            self.preemptor.release(seq)  # swapped out: its copy in the old host pool is dropped
            self.scheduler.remove(seq)
            _reset(seq, self.config.block_size)
        for request_id in list(self._deferred_aborts):
            self._deferred_aborts.discard(request_id)
            seq = self._requests.get(request_id)
            if seq is not None:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                seq.metrics = seq.metrics.but(finish_time=time.time())
                self._detokenizers[request_id].finish()
                self._pending.append(self._output(seq, []))
        self.executor = executor
        self.setup = self.setup_for(executor)
        self.config = self.setup.config
        self._schedule_on(layout)
        for seq in waiting:
            if seq.is_finished:
                continue
            self.scheduler.add(seq)
            if seq.params.seed is not None and seq.params.temperature > 0:
                executor.resume(seq.seq_id, seq.num_output_tokens)  # one noise draw per sampled token
            moved.append(seq.request_id)
        return moved

    def remap(self, plan: Any, reason: str) -> Future:
        """Move serving to the pipeline of `plan` while it serves (a supervisor's; see
        `tessel.pipeline.supervision.supervisor`); -> a future of its `RemapReport`."""
        if self.supervisor is None:
            done: Future = Future()
            done.set_exception(TesselError("this engine cannot remap: it is not a pipeline (serve --plan)"))
            return done
        return self.supervisor.remap(plan, reason)

    @property
    def recovering(self) -> BaseException | None:
        """The failure a supervisor is recovering from (a new pipeline being built), or None."""
        return None if self.supervisor is None else self.supervisor.recovering


def _count_computed(batch: SchedulerOutput, failed: list[tuple[Sequence, Exception]]) -> list[Sequence]:
    """Count the computed tokens of `batch`'s sequences that did not fail; -> those sequences, in
    `SchedulerOutput.scheduled()` order."""
    if failed:
        failed_seqs = {id(seq) for seq, _ in failed}
        computed = []
        for seq, n in batch.scheduled():
            if id(seq) not in failed_seqs:
                seq.num_computed_tokens += n
                computed.append(seq)
        return computed
    for seq in batch.decodes:
        seq.num_computed_tokens += 1
    if not batch.prefills:
        return batch.decodes
    for seq, n in batch.prefills:
        seq.num_computed_tokens += n
    return batch.decodes + [seq for seq, _ in batch.prefills]


def _reset(seq: Sequence, block_size: int) -> None:
    """The sequence as a preempted one: no KV anywhere, everything to compute again."""
    seq.num_computed_tokens = 0
    seq.host_blocks = []
    seq.block_table = []
    seq.block_keys = []
    seq.num_registered_blocks = 0
    seq.block_size = block_size
    seq.status = SequenceStatus.WAITING


def _as_prompt_list(prompts: str | list[int] | SequenceABC[str | list[int]]) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


class LLM(LLMEngine):
    """`LLM(path, **engine kwargs).generate(prompts, SamplingParams(...))` -> outputs in input order.

    Every step's outputs are routed to the request that owns them (`_inbox`), so `generate` only
    collects its own requests and `generate` and `stream` can interleave: a `generate` called while
    a stream is open steps the stream's request too, and the stream later reads what it missed.
    """

    _request_ids = itertools.count()

    def __init__(self, model_path: str | Path, **kwargs: Any) -> None:
        super().__init__(model_path, **kwargs)
        self._inbox: dict[str, deque[RequestOutput]] = {}  # outputs not yet read, per own request

    def generate(
        self,
        prompts: str | list[int] | SequenceABC[str | list[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_progress: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in input order. A request that failed has finish_reason "error" and `error` set.

        An interrupted call (KeyboardInterrupt, an error) aborts the requests it added.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise TesselError(f"got {len(prompt_list)} prompts but {len(params_list)} sampling params")
        ids = [f"gen-{next(self._request_ids)}" for _ in prompt_list]
        finals: dict[str, RequestOutput] = {}
        try:
            for rid, prompt, params in zip(ids, prompt_list, params_list, strict=True):
                self._add_own(rid, prompt, params)
            with _Progress(len(ids), enabled=use_progress and len(ids) > 1) as progress:
                while len(finals) < len(ids):
                    self._step_and_route()
                    for rid in [rid for rid in ids if rid not in finals]:
                        final = self._take_final(rid)
                        if final is not None:
                            finals[rid] = final
                            progress.advance(final.num_output_tokens)
        finally:
            for rid in ids:
                if rid not in finals:
                    self._drop_own(rid)
        return [finals[rid] for rid in ids]

    def stream(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that changed it; the last has finished=True."""
        rid = f"stream-{next(self._request_ids)}"
        self._add_own(rid, prompt, sampling_params)
        try:
            while True:
                inbox = self._inbox[rid]
                if not inbox:
                    if rid not in self._requests and not self._pending:
                        raise TesselError(f"request {rid} is no longer in the engine")  # never spin
                    self._step_and_route()
                    continue
                out = inbox.popleft()
                yield out
                if out.finished:
                    return
        finally:
            self._drop_own(rid)

    def _add_own(self, rid: str, prompt: str | list[int], params: SamplingParams | None) -> None:
        self.add_request(rid, prompt, params)
        self._inbox[rid] = deque()

    def _drop_own(self, rid: str) -> None:
        """Abort `rid` (no-op once finished) and forget its outputs, the abort's included."""
        self.abort_request(rid)
        self._pending = [o for o in self._pending if o.request_id != rid]
        self._inbox.pop(rid, None)

    def _step_and_route(self) -> None:
        for out in self.step():
            inbox = self._inbox.get(out.request_id)
            if inbox is not None:  # outputs of requests nobody reads (aborted, added directly) drop
                inbox.append(out)

    def _take_final(self, rid: str) -> RequestOutput | None:
        inbox = self._inbox[rid]
        if inbox and inbox[-1].finished:
            del self._inbox[rid]
            return inbox[-1]
        inbox.clear()  # generate reads only the final output
        return None


class _Progress:
    """A rich progress bar over finished requests, with output tokens per second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tokens = 0
        self.start = time.perf_counter()

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[rate]}"), transient=True,
            )  # fmt: skip
            self.bar.start()
            self.task = self.bar.add_task("generate", total=self.total, rate="")
        return self

    def advance(self, num_tokens: int) -> None:
        self.tokens += num_tokens
        if self.enabled:
            rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
            self.bar.update(self.task, advance=1, rate=f"{rate:.1f} tok/s")

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.bar.stop()


def _stop_token(params: SamplingParams, token: int, eos_token_ids) -> bool:  # noqa: ANN001 (a set or frozenset)
    """The token stop rules (EOS unless ignored, `stop_token_ids`): one place for both ways of
    applying a step's tokens (`_append`, the bulk `_apply_tokens`)."""
    return (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids


def _at_length(seq: Sequence, max_model_len: int) -> bool:
    """The length rules, after the token is appended: `max_tokens` generated, or the context full."""
    return len(seq.token_ids) - seq.num_prompt_tokens >= seq.max_tokens or len(seq.token_ids) >= max_model_len
