"""`TensorParallelExecutor`: the whole model split over `degree` ranks, this process rank 0.

The engine is unchanged: it schedules, and `launch` runs the step on the leader's runner
(`LeaderRunner`), which broadcasts each forward to the follower processes (`TPRanks`); every rank
runs the forward on its shards (one all-reduce after each row-parallel linear), the LM head's
logit columns are gathered on the leader, which samples. The KV pool has as many blocks as one
process's would (each rank holds its heads' share of every block), so scheduling, and with it
preemption, is one process's.

Everything checkable is refused before a process starts (`TPSplit.of`, `check_gpus`). A follower
that dies makes the leader's next collective fail (its connection closes, or the shared-memory
all-reduce finds its process gone); a watcher thread also notices the exit: either way `failure`
names the rank and its cause, the step raises it and the engine stops with that error. A step
that raises on the leader stops the engine too: the ranks' collectives cannot be realigned, so
batches are not bisected as `LocalExecutor` does.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import torch

from tessel.engine.engine_config import EngineConfig
from tessel.engine.executor import EngineSetup, ExecutorLayout, InFlightBatch, KvCopies, local_kv_blocks
from tessel.engine.model_runner import StepResult
from tessel.models.config import ModelConfig
from tessel.parallel.group import check_gpus
from tessel.parallel.load import load_rank
from tessel.parallel.ranks import TPRanks
from tessel.parallel.runner import LeaderRunner
from tessel.parallel.split import TPSplit

SWAP_REFUSED = "preemption by swapping does not run tensor-parallel yet; use preemption_mode='recompute'"


def full_kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block of the whole model (every rank together)."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per_token * block_size * dtype.itemsize


def check_tensor_parallel(
    config: ModelConfig, degree: int, device: str, gpus: list[int] | None, where: str = "the engine"
) -> TPSplit:
    """The split, or TesselError before any process starts (heads, KV heads, GPUs)."""
    split = TPSplit.of(config, degree, where)
    if degree > 1 and torch.device(device).type == "cuda":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        check_gpus(gpus if gpus is not None else list(range(degree)), degree, visible, where)
    return split


class TensorParallelExecutor:
    runs_ahead = False  # the ranks' steps are not overlapped yet (tessel.engine.run_ahead)
    overlaps = False

    def __init__(self, degree: int, gpus: list[int] | None = None, threads: int | None = None) -> None:
        """`degree` ranks; on CUDA rank r on GPU gpus[r] (None: GPU r); `threads`: torch threads per
        follower (None: this process's count)."""
        self.degree, self.gpus, self.threads = degree, gpus, threads
        self.ranks: TPRanks | None = None
        self._failure: BaseException | None = None

    @property
    def failure(self) -> BaseException | None:
        return self._failure or (self.ranks.failure if self.ranks is not None else None)

    @failure.setter
    def failure(self, value: BaseException | None) -> None:
        self._failure = value

    @property
    def procs(self) -> list:
        return [] if self.ranks is None else self.ranks.procs

    def configure(self, config: EngineConfig) -> EngineConfig:
        return dataclasses.replace(config, enforce_eager=True)  # the graphs hold no collectives

    def start(self, setup: EngineSetup) -> ExecutorLayout:
        config = setup.config
        split = check_tensor_parallel(setup.model_config, self.degree, config.device, self.gpus)
        per_block = full_kv_bytes_per_block(setup.model_config, config.block_size, setup.dtype)
        num_blocks = local_kv_blocks(config, setup.max_model_len, per_block)
        self.ranks = TPRanks(self.degree, Path(tempfile.mkdtemp(prefix="tessel-tp-")))
        group = self.ranks.start(setup.model_path, setup.dtype, config.device, self.gpus, self.threads)
        try:
            self.model = load_rank(setup.model_path, setup.dtype, group, split).model
            self.runner = LeaderRunner(
                group, self.model, num_blocks, config.block_size, setup.dtype, config.pack_cpu_linears
            )
        except Exception as error:
            self.ranks.stop(None)
            raise self.ranks.named(error) from error
        return ExecutorLayout(num_blocks, kv_cache=self.runner.kv_cache, swap_refused=SWAP_REFUSED)

    def launch(self, micro_batch: InFlightBatch, kv_copies: KvCopies) -> None:
        if self.failure is not None:
            raise self.failure
        started = time.perf_counter()
        try:
            micro_batch.result = self.runner.run(micro_batch.batch)
        except Exception as error:
            self.failure = self.ranks.named(error)
            raise self.failure from error
        micro_batch.compute_s = time.perf_counter() - started

    def ready(self, micro_batch: InFlightBatch) -> bool:
        return micro_batch.result is not None

    def collect(self, micro_batch: InFlightBatch) -> StepResult:
        assert micro_batch.result is not None, "a tensor-parallel micro-batch is computed when launched"
        return micro_batch.result

    def release(self, seq_ids: list[int]) -> None:
        return None

    def resume(self, seq_id: int, draws: int) -> None:
        return None

    def count_from_here(self) -> None:
        return None

    def chunk_sizes(self, num_tokens: int) -> list[int] | None:
        return None

    def shutdown(self) -> None:
        """Tell the followers to stop and wait for them (terminate any that does not exit); their
        logs' directory is removed unless a rank failed (its log names the cause)."""
        if self.ranks is None:
            return
        runner = getattr(self, "runner", None)
        self.ranks.stop(runner.stop_followers if runner is not None and self._failure is None else None)
        if self.failure is None:
            shutil.rmtree(self.ranks.run_dir, ignore_errors=True)
