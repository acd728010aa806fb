"""The engine loop (`LLMEngine`: add_request / step / abort_request) and the `LLM` front end.

`LLMEngine.step()` schedules one batch, runs it, appends the sampled tokens, applies the stop
rules (EOS, stop token ids, stop strings, max_tokens, max_model_len) and returns one
`RequestOutput` per request that changed. `LLM.generate` drives it to completion; `LLM.stream`
yields the outputs of one request as they come.

One bad request never takes the others down: requests are validated when added, and when a
batched step raises, the batch is bisected (`_run_isolated`) until the failing request is found;
it finishes with `finish_reason="error"` (its `RequestOutput.error` holds the exception) and the
others get their tokens. Only a failure that every request of a multi-request batch hits alone
(the model, not a request) escapes `step()`; `reset()` then fails everything in flight.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

from tessel.engine.block_manager import BlockManager
from tessel.engine.detokenizer import IncrementalDetokenizer
from tessel.engine.engine_config import (
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    EngineConfig,
)
from tessel.engine.host_kv_pool import HostKvPool
from tessel.engine.memory import available_memory_bytes, check_host_kv_cache_fits, check_kv_cache_fits
from tessel.engine.model_runner import ModelRunner, StepResult, kv_cache_bytes_per_block
from tessel.engine.outputs import RequestOutput
from tessel.engine.preemption import PreemptionStats, Preemptor, host_pool_blocks, measure_host_link
from tessel.engine.sampling_params import SamplingParams
from tessel.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tessel.engine.sequence import RequestMetrics, Sequence
from tessel.errors import TesselError
from tessel.layers.linear.tuning import tune_linears
from tessel.models.config import ModelConfig, resolve_dtype
from tessel.models.gguf import resolve_model_path
from tessel.models.llama import LlamaForCausalLM
from tessel.models.loader import load_model
from tessel.text import check_text

__all__ = ["LLM", "LLMEngine", "RequestMetrics", "RequestOutput", "SamplingParams"]


def _load_tokenizer(path: Path) -> Any:
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
        return min(limit, c.sliding_window or limit)
    if config.max_model_len > limit:
        raise TesselError(
            f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={limit}"
        )
    if c.sliding_window and config.max_model_len > c.sliding_window:
        raise TesselError(
            f"max_model_len={config.max_model_len} exceeds the sliding window ({c.sliding_window}); "
            "tessel has no sliding-window attention, so set max_model_len <= the window"
        )
    return config.max_model_len


class LLMEngine:
    def __init__(self, model_path: str | Path, **kwargs: Any) -> None:
        self.config = EngineConfig(**kwargs)
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
        self.max_model_len = self._max_model_len()
        self.tokenizer = self._load_tokenizer(path)
        self.model = self._load_model(path)
        num_blocks = self._num_kv_blocks()
        self.block_manager = BlockManager(
            num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                self.config.max_num_seqs, self._max_num_batched_tokens(), self.config.enable_chunked_prefill
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            self.config.block_size,
            self.dtype,
            self.config.pack_cpu_linears,
            self.config.enforce_eager,
            self.config.device,
            self.config.max_num_seqs,
            self.max_model_len,
        )
        self.preemptor = self._build_preemptor()
        self.scheduler.preemptor = self.preemptor
        eos = set(self.model_config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self._requests: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._emitted: dict[str, int] = {}  # characters of text already returned per request
        self._pending: list[RequestOutput] = []  # outputs of aborts, returned by the next step()

    def _load_tokenizer(self, path: Path) -> Any:
        """The checkpoint's tokenizer (a pipeline built beside a serving one has it loaded already)."""
        return _load_tokenizer(path)

    def _load_model(self, path: Path) -> LlamaForCausalLM:
        """The whole model; a pipeline stage (`tessel.pipeline`) loads only its layers."""
        return load_model(path, self.dtype, self.config.device, lm_head=self.config.lm_head)

    def _build_preemptor(self) -> Preemptor:
        """The preemption policy; with swapping possible, a host pool and a measured host link."""
        config = self.config
        if config.preemption_mode == "recompute":
            return Preemptor("recompute", self.block_manager)
        per_block = kv_cache_bytes_per_block(self.model, config.block_size, self.dtype)
        device_blocks, host_bytes = self.block_manager.num_total_blocks, available_memory_bytes()
        share = self._kv_layer_share()
        blocks = host_pool_blocks(config.host_kv_cache_gib, per_block, device_blocks, host_bytes, share)
        pool = HostKvPool(blocks, self.runner.kv_cache, config.emulate_host_gbps)
        link = measure_host_link(self.runner.kv_cache.device, config.emulate_host_gbps)
        return Preemptor(config.preemption_mode, self.block_manager, pool, link)

    def _kv_layer_share(self) -> float:
        """The share of the model's attention layers whose KV this process holds (a pipeline: stage 0's)."""
        return 1.0

    @property
    def preemption_stats(self) -> PreemptionStats:
        """Preemptions by mode and KV bytes moved to the host and back, since the engine started."""
        return self.preemptor.stats

    # ---- sizing -------------------------------------------------------------------------------
    def _max_model_len(self) -> int:
        return max_model_len(self.config, self.model_config)

    def _max_num_batched_tokens(self) -> int:
        tokens = self.config.max_num_batched_tokens
        if tokens is None:
            tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
            return tokens if self.config.enable_chunked_prefill else max(tokens, self.max_model_len)
        if not self.config.enable_chunked_prefill and tokens < self.max_model_len:
            raise TesselError(
                f"max_num_batched_tokens={tokens} < max_model_len={self.max_model_len} needs chunked "
                "prefill; enable it or raise max_num_batched_tokens"
            )
        return tokens

    def _num_kv_blocks(self) -> int:
        bs = self.config.block_size
        per_block = kv_cache_bytes_per_block(self.model, bs, self.dtype)
        blocks_per_seq = -(-self.max_model_len // bs)
        if self.config.num_kv_blocks is not None:
            num_blocks = self.config.num_kv_blocks
        elif self.config.kv_cache_gib is not None:
            num_blocks = int(self.config.kv_cache_gib * 2**30 // per_block)
        else:
            wanted = self.config.max_num_seqs * blocks_per_seq
            num_blocks = max(blocks_per_seq, min(wanted, DEFAULT_KV_CACHE_BYTES // per_block))
        if num_blocks < blocks_per_seq:
            raise TesselError(
                f"the KV cache holds {num_blocks * bs} tokens ({num_blocks} blocks of {bs}), fewer than "
                f"max_model_len={self.max_model_len}; raise kv_cache_gib or lower max_model_len"
            )
        return num_blocks

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
        capture every bucket of rows (`tessel.engine.cuda_graph`, on dummy rows). On CPU: one decode
        step per bucket of rows the compiled graph takes
        (`StepPlan.warm_up_rows`: one row where the linears have one-row forms, with its first
        attention bucket; every bucket up to `max_num_seqs` where some linear is split), each row a
        two-token dummy sequence on a block freed afterwards, outside the scheduler and the prefix
        cache. A one-row step's longer attention buckets compile when a context first reaches them
        (docs/engine.md)."""
        plan = self.runner.plan
        if plan.cuda_graphs is not None:
            tune_linears(self.model, self._max_num_batched_tokens(), self.dtype)
            return plan.cuda_graphs.capture_all()
        rows = plan.warm_up_rows(self.config.max_num_seqs)
        if not rows:
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
        return self.scheduler.num_unfinished > 0 or bool(self._pending)

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
            self.tokenizer, ids, params.stop, params.skip_special_tokens
        )
        self._emitted[request_id] = 0
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks; the next `step()` reports it as "abort"."""
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return
        self.scheduler.finish(seq, "abort")
        self._detokenizers[request_id].finish()
        self._pending.append(self._output(seq, []))

    def reset(self, error: BaseException) -> list[RequestOutput]:
        """Finish every unfinished request with `error` (after a step failed for all of them)."""
        outputs, self._pending = self._pending, []
        for seq in list(self._requests.values()):
            if not seq.is_finished:
                outputs.append(self._fail(seq, error))
        return outputs

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return outputs
        started = time.perf_counter()
        result, failed = self._run_isolated(batch.scheduled())
        if batch.prefills and not failed:  # what recomputing a context costs (tessel.engine.preemption)
            self.preemptor.clock.record(batch.num_tokens, time.perf_counter() - started)
        if failed and not result.seqs and len(failed) > 1:
            raise failed[0][1]  # every request failed on its own: the engine, not a request
        return outputs + self._finish_step(batch, result, failed)

    def _finish_step(
        self, batch: SchedulerOutput, result: StepResult, failed: list[tuple[Sequence, BaseException]]
    ) -> list[RequestOutput]:
        """Count the step's computed tokens, append the sampled ones, apply the stop rules."""
        outputs = []
        failed_seqs = {id(seq) for seq, _ in failed}
        for seq, error in failed:
            outputs.append(self._fail(seq, error))
        for seq, n in batch.scheduled():
            if id(seq) not in failed_seqs:
                seq.num_computed_tokens += n
                self.block_manager.register_computed_blocks(seq)
        for seq, first, logprobs in result.prompt_logprobs:
            seq.prompt_logprobs[first : first + len(logprobs)] = logprobs
        now = time.time()
        for seq, token, logprobs in zip(result.seqs, result.tokens, result.logprobs, strict=True):
            if logprobs is not None:
                seq.logprobs.append(logprobs)
            try:
                self._append(seq, token, now)
            except Exception as error:  # e.g. a token the tokenizer cannot decode
                outputs.append(self._fail(seq, error))
                continue
            outputs.append(self._output(seq, [token]))
        return outputs

    def _run_isolated(
        self, parts: list[tuple[Sequence, int]]
    ) -> tuple[StepResult, list[tuple[Sequence, Exception]]]:
        """Run `parts`; if that raises, bisect -> (what ran, (seq, its error) for each failing seq).

        Re-running a part is safe: its k/v land in the same slots with the same values.
        """
        try:
            return self.runner.run(_batch_of(parts)), []
        except Exception as error:
            if len(parts) == 1:
                return StepResult(), [(parts[0][0], error)]
        half = len(parts) // 2
        result, failed = self._run_isolated(parts[:half])
        right, right_failed = self._run_isolated(parts[half:])
        result.extend(right)
        return result, failed + right_failed

    def _fail(self, seq: Sequence, error: BaseException) -> RequestOutput:
        seq.error = error
        self.scheduler.finish(seq, "error")
        self._detokenizers[seq.request_id].finish()
        return self._output(seq, [])

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        seq.append_token(token)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        params, detok = seq.params, self._detokenizers[seq.request_id]
        reason = None
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            reason = "stop"
        elif detok.add_token(token) is not None:
            reason = "stop"
        elif seq.num_output_tokens >= seq.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            detok.finish()
            self.scheduler.finish(seq, reason)

    def _output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        rid = seq.request_id
        text = self._detokenizers[rid].text
        new_text = text[self._emitted[rid] :]
        self._emitted[rid] = len(text)
        finished = seq.is_finished
        if finished:
            del self._requests[rid], self._detokenizers[rid], self._emitted[rid]
        output_ids = seq.output_token_ids
        return RequestOutput(
            request_id=rid,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=output_ids,
            new_token_ids=new_token_ids,
            text=text,
            new_text=new_text,
            finished=finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(output_ids),
            metrics=dataclasses.replace(seq.metrics),  # a snapshot: later steps do not change it
            prompt=seq.prompt,
            error=seq.error,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
        )


def _batch_of(parts: list[tuple[Sequence, int]]) -> SchedulerOutput:
    """The scheduler output that runs exactly `parts` (in `SchedulerOutput.scheduled()` order)."""
    return SchedulerOutput(
        decodes=[seq for seq, n in parts if n == 1], prefills=[(seq, n) for seq, n in parts if n != 1]
    )


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
