"""`TensorParallelExecutor`: the whole model split over `degree` ranks, this process rank 0.

The engine is unchanged: it schedules, and `launch` runs the step on the leader's runner
(`LeaderRunner`), which broadcasts the prepared step to the follower processes before its forward;
every rank runs the forward on its shards (one all-reduce after each row-parallel linear), the
LM head's logit columns are gathered on the leader, which samples. The KV pool has as many blocks
as one process's would (each rank holds its heads' share of every block), so scheduling, and with
it preemption, is one process's.

Everything checkable is refused before a process starts (`TPSplit.of`, `check_gpus`). A follower
that dies makes the leader's next collective fail (its connection closes); a watcher thread also
notices the exit: either way `failure` names the rank and its cause, the step raises it and the
engine stops with that error. A step that raises on the leader stops the engine too: the ranks'
collectives cannot be realigned, so batches are not bisected as `LocalExecutor` does.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from tessel.engine.engine_config import EngineConfig
from tessel.engine.executor import EngineSetup, ExecutorLayout, InFlightBatch, KvCopies, local_kv_blocks
from tessel.engine.model_runner import StepResult
from tessel.models.config import ModelConfig
from tessel.parallel.follower import RankOptions
from tessel.parallel.group import RankLostError, TPGroup, check_gpus, join_tp_group, rank_device
from tessel.parallel.load import load_rank
from tessel.parallel.runner import LeaderRunner
from tessel.parallel.split import TPSplit
from tessel.pipeline.supervision.launcher import die_with_parent, failure_cause_of, free_port, terminate

WATCH_INTERVAL_S = 0.2  # how often the watcher polls the followers
CAUSE_WAIT_S = 2.0  # how long a failed collective waits for the watcher to name the rank
SWAP_REFUSED = "preemption by swapping does not run tensor-parallel yet; use preemption_mode='recompute'"


def full_kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block of the whole model (every rank together)."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per_token * block_size * dtype.itemsize


def check_tensor_parallel(config: ModelConfig, degree: int, device: str, gpus: list[int] | None) -> TPSplit:
    """The split, or TesselError before any process starts (heads, KV heads, GPUs)."""
    split = TPSplit.of(config, degree)
    if torch.device(device).type == "cuda":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        check_gpus(gpus if gpus is not None else list(range(degree)), degree, visible)
    return split


class TensorParallelExecutor:
    def __init__(self, degree: int, gpus: list[int] | None = None, threads: int | None = None) -> None:
        """`degree` ranks; on CUDA rank r on GPU gpus[r] (None: GPU r); `threads`: torch threads per
        follower (None: this process's count)."""
        self.degree, self.gpus, self.threads = degree, gpus, threads
        self.failure: BaseException | None = None
        self.procs: list[subprocess.Popen] = []
        self.run_dir: Path | None = None
        self._stopping = False

    def configure(self, config: EngineConfig) -> EngineConfig:
        # eager: the compiled CPU and captured CUDA graphs hold no collectives
        return dataclasses.replace(config, enforce_eager=True)

    def start(self, setup: EngineSetup) -> ExecutorLayout:
        config = setup.config
        split = check_tensor_parallel(setup.model_config, self.degree, config.device, self.gpus)
        per_block = full_kv_bytes_per_block(setup.model_config, config.block_size, setup.dtype)
        num_blocks = local_kv_blocks(config, setup.max_model_len, per_block)
        port = free_port()
        self.run_dir = Path(tempfile.mkdtemp(prefix="tessel-tp-"))
        for rank in range(1, self.degree):
            options = RankOptions(
                str(setup.model_path),
                str(setup.dtype).removeprefix("torch."),
                str(rank_device(config.device, self.gpus, rank)),
                rank,
                self.degree,
                "127.0.0.1",
                port,
                num_blocks,
                config.block_size,
                config.pack_cpu_linears,
                self.threads if self.threads is not None else torch.get_num_threads(),
            )
            self.procs.append(self._spawn(options))
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        device = rank_device(config.device, self.gpus, 0)
        self.group = self._join(device, port)
        self.model = load_rank(setup.model_path, setup.dtype, self.group, split).model
        self.runner = LeaderRunner(
            self.group,
            self.model,
            num_blocks,
            config.block_size,
            setup.dtype,
            config.pack_cpu_linears,
            True,
            device,
        )
        return ExecutorLayout(num_blocks, kv_cache=self.runner.kv_cache, swap_refused=SWAP_REFUSED)

    def _spawn(self, options: RankOptions) -> subprocess.Popen:
        assert self.run_dir is not None
        path = self.run_dir / f"rank{options.rank}.json"
        options.write(path)
        with open(self.run_dir / f"rank{options.rank}.log", "wb") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "tessel.parallel.follower", "--options", str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
            )

    def _join(self, device: torch.device, port: int) -> TPGroup:
        try:
            return join_tp_group(0, self.degree, device, "127.0.0.1", port)
        except Exception as error:
            self.shutdown()
            raise self._named(error) from error

    def _watch(self) -> None:
        """Set `failure` when a follower exits before the executor stops it."""
        while not self._stopping and self.failure is None:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopping:
                    self.failure = RankLostError(
                        f"tensor-parallel rank {rank} (pid {proc.pid}) {self._cause(rank, code)}"
                    )
                    return
            time.sleep(WATCH_INTERVAL_S)

    def _cause(self, rank: int, code: int) -> str:
        assert self.run_dir is not None
        try:
            lines = (self.run_dir / f"rank{rank}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return failure_cause_of(code, {}, " | ".join(lines[-3:]))[1]

    def _named(self, error: BaseException) -> BaseException:
        """The watcher's named failure for a failed collective (waited for briefly), else `error`."""
        deadline = time.monotonic() + CAUSE_WAIT_S
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(WATCH_INTERVAL_S / 2)
        return self.failure if self.failure is not None else error

    def launch(self, micro_batch: InFlightBatch, kv_copies: KvCopies) -> None:
        if self.failure is not None:
            raise self.failure
        started = time.perf_counter()
        try:
            micro_batch.result = self.runner.run(micro_batch.batch)
        except Exception as error:
            self.failure = self._named(error)
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
        """Tell the followers to stop, wait for them (terminate any that does not)."""
        if self._stopping:
            return
        self._stopping = True
        if self.failure is None and getattr(self, "runner", None) is not None:
            try:
                self.runner.stop_followers()
            except RankLostError:
                pass
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        terminate([p for p in self.procs if p.poll() is None])
