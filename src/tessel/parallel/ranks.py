"""The leader's side of a tensor-parallel rank set: start the followers, join them, watch them.

Used by `TensorParallelExecutor` (the engine's process is the leader) and by a pipeline stage of
`tp_degree` > 1 (the stage's process is the leader of its own rank set). Followers are processes of
this machine that die with their leader (`PR_SET_PDEATHSIG`), each logging to `<prefix>rank<r>.log`
in the run directory. A follower that exits is noticed by a watcher thread (`failure`, naming the
rank and its cause: the signal, or its log's last lines), and by the leader's next collective. A
follower stopped (SIGSTOP, a debugger's stop) for `shm.STOPPED_LIMIT_S` holds the leader in its next
collective for as long as it stays stopped (gloo waits on an open socket): the watcher then names it
and kills it, which ends that collective with the watcher's message instead of a hang.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessel.models.layer_filter import LayerFilter
from tessel.parallel import shm
from tessel.parallel.follower import RankOptions
from tessel.parallel.group import RankLostError, TPGroup, join_tp_group, rank_device
from tessel.pipeline.supervision.launcher import die_with_parent, failure_cause_of, free_port, terminate

WATCH_INTERVAL_S = 0.2  # how often the watcher polls the followers
CAUSE_WAIT_S = 2.0  # how long a failed collective waits for the watcher to name the rank
STOP_WAIT_S = 10.0  # followers told to stop get this long to exit before they are terminated


@dataclass
class TPRanks:
    degree: int
    run_dir: Path
    prefix: str = ""  # of the followers' files in run_dir (a pipeline stage's: "stage<k>.")
    procs: list[subprocess.Popen] = field(default_factory=list)
    failure: BaseException | None = None
    stopping: bool = False

    def start(
        self,
        model_path: Path,
        dtype: torch.dtype,
        device: str,
        gpus: list[int] | None = None,
        threads: int | None = None,
        layers: LayerFilter | None = None,
        precisions: dict[int, tuple[str, str]] | None = None,
    ) -> TPGroup:
        """Start ranks 1.. (they load their shards while this one does), join them -> the group."""
        port = free_port()
        for rank in range(1, self.degree):
            options = RankOptions(
                str(model_path),
                str(dtype).removeprefix("torch."),
                str(rank_device(device, gpus, rank)),
                rank,
                self.degree,
                "127.0.0.1",
                port,
                threads if threads is not None else torch.get_num_threads(),
                None if layers is None else [layers.layer_start, layers.layer_end, layers.embed, layers.head],
                bool(layers.tied) if layers is not None else False,
                {str(k): list(v) for k, v in precisions.items()} if precisions else None,
            )
            self.procs.append(self._spawn(options))
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        try:
            return join_tp_group(0, self.degree, rank_device(device, gpus, 0), "127.0.0.1", port)
        except Exception as error:
            self.stop(None)
            raise self.named(error) from error

    def _spawn(self, options: RankOptions) -> subprocess.Popen:
        path = self.run_dir / f"{self.prefix}rank{options.rank}.json"
        options.write(path)
        with open(self.run_dir / f"{self.prefix}rank{options.rank}.log", "wb") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "tessel.parallel.follower", "--options", str(path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
            )

    def _watch(self) -> None:
        """Set `failure` when a follower exits before it is told to stop, or stays stopped."""
        stopped_since: dict[int, float] = {}
        while not self.stopping and self.failure is None:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self.stopping:
                    cause = self._cause(rank, code)
                    self.failure = RankLostError(f"tensor-parallel rank {rank} (pid {proc.pid}) {cause}")
                    return
                if self._stopped_too_long(rank, proc, stopped_since):
                    return
            time.sleep(WATCH_INTERVAL_S)

    def _stopped_too_long(self, rank: int, proc: subprocess.Popen, stopped_since: dict[int, float]) -> bool:
        """Whether follower `rank` has been stopped for the limit (then named in `failure`, killed)."""
        if shm.process_state(proc.pid) not in shm.STOPPED_STATES:
            stopped_since.pop(rank, None)
            return False
        now = time.monotonic()
        since = stopped_since.setdefault(rank, now)
        if now - since < shm.STOPPED_LIMIT_S:
            return False
        self.failure = RankLostError(
            f"tensor-parallel rank {rank} (pid {proc.pid}) has been stopped for {now - since:.0f} s (SIGSTOP "
            "or a debugger) and was killed: every rank waits for it in each step"
        )
        proc.kill()
        return True

    def _cause(self, rank: int, code: int) -> str:
        try:
            log = self.run_dir / f"{self.prefix}rank{rank}.log"
            lines = log.read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return failure_cause_of(code, {}, " | ".join(lines[-3:]))[1]

    def named(self, error: BaseException) -> BaseException:
        """The watcher's named failure for a failed collective (waited for briefly), else `error`."""
        deadline = time.monotonic() + CAUSE_WAIT_S
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(WATCH_INTERVAL_S / 2)
        return self.failure if self.failure is not None else error

    def stop(self, tell: object | None) -> None:
        """`tell()` the followers to stop (None: they are gone or cannot hear), wait for them,
        terminate any that does not exit."""
        if self.stopping:
            return
        self.stopping = True
        if tell is not None and self.failure is None:
            try:
                tell()
            except RankLostError:
                pass
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        terminate([p for p in self.procs if p.poll() is None])
