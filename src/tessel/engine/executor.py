"""Where the engine's steps run: one interface, one executor per place to run.

`LLMEngine` owns the requests, the scheduling and the outputs; an executor runs what it schedules,
as vLLM's engine core hands steps to `UniProcExecutor`, `MultiprocExecutor` or
`RayDistributedExecutor`. The engine never learns where the model lives:

- `start(setup)` loads what the executor runs (the whole model, or stage 0's layers and the other
  stages wherever they live) and returns the `ExecutorLayout` the engine schedules against: the
  KV blocks every stage holds, the in-flight slots per path, the block id ranges of several paths,
  stage 0's KV cache (the host pool of swapped blocks copies to and from it);
- `launch(micro_batch)` runs a scheduled micro-batch (here at once; a pipeline computes stage 0's
  layers and sends it on), `ready(micro_batch)` says whether its tokens are back without waiting,
  `collect(micro_batch)` waits for them and returns the `StepResult`;
- `release`, `resume` and `count_from_here` pass on what the stages after the first must know of
  the requests; `failure` is set when a stage is lost; `shutdown` ends it.

`LocalExecutor` runs the whole model in this process with the engine's `ModelRunner`: one path, one
slot, each micro-batch computed and sampled when launched (with `overlap`, the engine's
`async_scheduling`, a decode micro-batch on a worker thread instead: `tessel.engine.run_ahead`). A
batch whose step raises is bisected
until the failing request is found (`run_isolated`): one bad request never takes the others down.
The pipeline's executor is `tessel.pipeline.executor.ProcessExecutor`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from tessel.engine.engine_config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from tessel.engine.model_runner import (
    ModelRunner,
    Prepared,
    PromptScoring,
    StepResult,
    kv_cache_bytes_per_block,
    prompt_scorings,
)
from tessel.engine.preemption import KvCopy
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence
from tessel.engine.slots import SlotPath
from tessel.errors import TesselError
from tessel.models.config import ModelConfig
from tessel.models.llama import LlamaForCausalLM
from tessel.models.loader import load_model


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """What an executor is started from: the engine's settings and what it read of the model."""

    model_path: Path
    config: EngineConfig
    model_config: ModelConfig
    dtype: torch.dtype
    max_model_len: int


@dataclass(slots=True)
class ExecutorLayout:
    """What the engine schedules against once the executor has started (every stage agreed)."""

    num_blocks: int  # KV blocks of the engine's block tables
    paths: tuple[SlotPath, ...] = (SlotPath(1.0, 1),)
    block_ranges: list[tuple[int, int]] | None = None  # per path, with several paths (no prefix cache)
    kv_cache: torch.Tensor | None = None  # stage 0's: swapped blocks are copied to and from it
    kv_layer_share: float = 1.0  # stage 0's share of the model's attention layers (host pool size)
    records_kv_copies: bool = False  # later stages repeat stage 0's host copies (`Preemptor.copies`)
    swap_refused: str | None = None  # why preemption by swapping cannot run here (None: it can)


@dataclass(slots=True)
class InFlightBatch:
    """A scheduled batch on its way through the executor, until its tokens are applied."""

    batch_id: int
    slot: int
    batch: SchedulerOutput  # what runs
    apply: SchedulerOutput | None  # what to count when it is back (None: a CPP chunk before the last)
    sampled: list[Sequence]  # sequences whose next token it samples, in row order
    scorings: list[tuple[Sequence, PromptScoring]]  # chunks whose prompt logprobs come back
    compute_s: float = 0.0  # this process's compute seconds for it (prefill pricing)
    result: StepResult | None = None  # set once its tokens are here
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # requests that failed alone
    pending: Future | None = None  # its step on an overlapping executor's worker thread, until collected
    ahead: bool = False  # launched before the last step's tokens were applied (`tessel.engine.run_ahead`)
    _seq_ids: list[int] | None = None

    @classmethod
    def of(
        cls, batch_id: int, slot: int, batch: SchedulerOutput, apply: SchedulerOutput | None
    ) -> InFlightBatch:
        if batch.prefills:
            parts = batch.scheduled()
            sampled = [seq for seq, n in parts if seq.num_computed_tokens + n == len(seq.token_ids)]
        else:  # the decode steps: no (seq, 1) pairs built
            sampled = [seq for seq in batch.decodes if seq.num_computed_tokens + 1 == len(seq.token_ids)]
        return cls(batch_id, slot, batch, apply, sampled, prompt_scorings(batch))

    @property
    def seq_ids(self) -> list[int]:
        """The ids of the sequences it runs (listed when first asked: the local executor never does
        unless a request is aborted)."""
        if self._seq_ids is None:
            self._seq_ids = [seq.seq_id for seq, _ in self.batch.scheduled()]
        return self._seq_ids


@dataclass(frozen=True, slots=True)
class KvCopies:
    """The copies stage 0 made to and from its host KV pool before a micro-batch (in order), which
    every later stage repeats on its own layers, and the host pool's size in blocks."""

    copies: list[KvCopy]
    host_blocks: int


class Executor(Protocol):
    """What the engine calls to run its steps (see the module docstring)."""

    runner: ModelRunner  # stage 0's: prepares a batch's tensors, holds stage 0's KV cache and graphs
    model: LlamaForCausalLM  # stage 0's layers (the whole model for one process)
    failure: BaseException | None  # set (by a watcher thread) once a stage is lost
    runs_ahead: bool  # the engine may launch a step before the last one's tokens are applied (run_ahead)
    overlaps: bool  # `launch` returns while the step computes (the engine's async_scheduling)

    def configure(self, config: EngineConfig) -> EngineConfig: ...
    def start(self, setup: EngineSetup) -> ExecutorLayout: ...
    def launch(self, micro_batch: InFlightBatch, kv_copies: KvCopies) -> None: ...
    def ready(self, micro_batch: InFlightBatch) -> bool: ...
    def collect(self, micro_batch: InFlightBatch) -> StepResult: ...
    def release(self, seq_ids: list[int]) -> None: ...
    def resume(self, seq_id: int, draws: int) -> None: ...
    def count_from_here(self) -> None: ...
    def chunk_sizes(self, num_tokens: int) -> list[int] | None: ...
    def shutdown(self) -> None: ...


def local_kv_blocks(config: EngineConfig, max_model_len: int, bytes_per_block: int) -> int:
    """KV blocks of one process's pool: `num_kv_blocks`, else `kv_cache_gib`, else room for
    max_num_seqs full-length sequences capped at `DEFAULT_KV_CACHE_BYTES`; refused when it holds
    fewer tokens than one full-length sequence."""
    bs = config.block_size
    blocks_per_seq = -(-max_model_len // bs)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_gib is not None:
        num_blocks = int(config.kv_cache_gib * 2**30 // bytes_per_block)
    else:
        wanted = config.max_num_seqs * blocks_per_seq
        num_blocks = max(blocks_per_seq, min(wanted, DEFAULT_KV_CACHE_BYTES // bytes_per_block))
    if num_blocks < blocks_per_seq:
        raise TesselError(
            f"the KV cache holds {num_blocks * bs} tokens ({num_blocks} blocks of {bs}), fewer than "
            f"max_model_len={max_model_len}; raise kv_cache_gib or lower max_model_len"
        )
    return num_blocks


def run_isolated(
    runner: ModelRunner, batch: SchedulerOutput
) -> tuple[StepResult, list[tuple[Sequence, Exception]]]:
    """Run `batch` as it is; if that raises, bisect it -> (what ran, (seq, its error) for each
    failing seq).

    Re-running a part is safe: its k/v land in the same slots with the same values.
    """
    try:
        return runner.run(batch), []
    except Exception as error:
        parts = batch.scheduled()
        if len(parts) == 1:
            return StepResult(), [(parts[0][0], error)]
    half = len(parts) // 2
    result, failed = run_isolated(runner, batch_of(parts[:half]))
    right, right_failed = run_isolated(runner, batch_of(parts[half:]))
    result.extend(right)
    return result, failed + right_failed


def batch_of(parts: list[tuple[Sequence, int]]) -> SchedulerOutput:
    """The scheduler output that runs exactly `parts` (in `SchedulerOutput.scheduled()` order)."""
    return SchedulerOutput(
        decodes=[seq for seq, n in parts if n == 1], prefills=[(seq, n) for seq, n in parts if n != 1]
    )


class LocalExecutor:
    """The whole model in this process: each micro-batch computed and sampled when launched, or, with
    `overlap` (the engine's `async_scheduling`), each decode micro-batch computed on a worker thread
    while the engine goes on (`tessel.engine.run_ahead`): `launch` returns at once, `collect` waits."""

    def __init__(self, overlap: bool = False) -> None:
        self.failure: BaseException | None = None
        self.overlap = overlap
        self._worker: ThreadPoolExecutor | None = None

    @property
    def runs_ahead(self) -> bool:
        """Whether the engine may prepare and launch a step before the last one's tokens are applied."""
        return self.overlap

    @property
    def overlaps(self) -> bool:
        return self.overlap

    def configure(self, config: EngineConfig) -> EngineConfig:
        return config

    def start(self, setup: EngineSetup) -> ExecutorLayout:
        config = setup.config
        self.model = load_model(setup.model_path, setup.dtype, config.device, lm_head=config.lm_head)
        per_block = kv_cache_bytes_per_block(self.model, config.block_size, setup.dtype)
        num_blocks = local_kv_blocks(config, setup.max_model_len, per_block)
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            config.block_size,
            setup.dtype,
            config.pack_cpu_linears,
            config.enforce_eager,
            config.device,
            config.max_num_seqs,
            setup.max_model_len,
        )
        if self.overlap:
            device = self.runner.device
            on_gpu = device.type == "cuda"  # the worker's current GPU is the engine's (per thread)
            self._worker = ThreadPoolExecutor(
                1,
                "tessel-step",
                initializer=torch.cuda.set_device if on_gpu else None,
                initargs=(device,) if on_gpu else (),
            )
        return ExecutorLayout(num_blocks, kv_cache=self.runner.kv_cache)

    def launch(self, micro_batch: InFlightBatch, kv_copies: KvCopies) -> None:
        if self._worker is None or micro_batch.batch.prefills:  # prefills: timed here (preemption's clock)
            started = time.perf_counter()
            result, failed = run_isolated(self.runner, micro_batch.batch)
            micro_batch.compute_s = time.perf_counter() - started
            micro_batch.result, micro_batch.failed = result, failed
            return
        self.launch_prepared(micro_batch, self.runner.prepare(micro_batch.batch))

    def launch_prepared(self, micro_batch: InFlightBatch, prepared: Prepared) -> None:
        """Start the forward and sampling of `micro_batch`, already prepared, on the worker thread."""
        assert self._worker is not None, "only an overlapping executor launches prepared steps"
        micro_batch.pending = self._worker.submit(
            self.runner.execute, prepared, micro_batch.sampled, micro_batch.scorings
        )

    def ready(self, micro_batch: InFlightBatch) -> bool:
        return micro_batch.result is not None or (
            micro_batch.pending is not None and micro_batch.pending.done()
        )

    def collect(self, micro_batch: InFlightBatch) -> StepResult:
        if micro_batch.result is None:
            assert micro_batch.pending is not None, "a local micro-batch is computed or on the worker"
            try:
                micro_batch.result = micro_batch.pending.result()
            except Exception:  # find the failing requests here, as a batch run in place is (bisected)
                micro_batch.result, micro_batch.failed = run_isolated(self.runner, micro_batch.batch)
            micro_batch.pending = None
        return micro_batch.result

    def release(self, seq_ids: list[int]) -> None:
        return None  # a sequence's generator lives on the sequence itself here

    def resume(self, seq_id: int, draws: int) -> None:
        return None

    def count_from_here(self) -> None:
        return None

    def chunk_sizes(self, num_tokens: int) -> list[int] | None:
        return None  # nothing to pipeline: a prompt is never cut into chunks here

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
