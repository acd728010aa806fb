"""Spawn one worker process per plan stage on this machine, and watch them.

Each worker gets the torchrun variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on
a free port) and `TESSEL_RUN_DIR`, where it writes its status (`stage<k>.json`), its heartbeat
(`stage<k>.beat`) and its stderr (`stage<k>.log`). The launcher polls them: when one exits with an
error, sends no heartbeat for the heartbeat timeout, or the pipeline is stuck
(`tessel.pipeline.supervision.heartbeat`), the others are terminated (SIGTERM and SIGCONT, then SIGKILL after
`TERMINATE_GRACE_S`) and a `StageFailedError` names the stage and the cause: the exception it
reported, the signal that killed it, or its silence. A stage whose only error is a lost peer is a
consequence, not a cause, and is named only if nothing else failed. Workers die with the launcher
(Linux `PR_SET_PDEATHSIG`), and Ctrl-C stops them all.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tessel.errors import TesselError
from tessel.pipeline.supervision.heartbeat import (
    HEARTBEAT_TIMEOUT_ENV,
    MASTER_LISTEN_FD_ENV,
    RUN_DIR_ENV,
    StageProgress,
    Watchdog,
    heartbeat_timeout_s,
    read_beat,
)
from tessel.ports import port_of, reserve_port

POLL_S = 0.05
WATCHDOG_INTERVAL_S = 0.25  # how often the heartbeat files are read
SETTLE_S = 1.0  # after a first failure, how long the others get to report theirs (to find the cause)
TERMINATE_GRACE_S = 5.0
DONE_GRACE_S = 30.0  # after stage 0 finishes, how long the others get to exit
PR_SET_PDEATHSIG = 1


class StageFailedError(TesselError):
    """A pipeline stage died or failed; the message names it and the cause."""

    recovery = "rebuild"  # a server's engine loop cannot bring a stage back; a new pipeline can

    def __init__(self, stage: int, cause: str, node: str | None = None) -> None:
        super().__init__(f"pipeline stage {stage} failed: {cause}", exit_code=1)
        self.stage, self.cause = stage, cause
        self.node = node  # the machine it ran on, when its loss is the machine's (a Ray pipeline)


@dataclass(slots=True)
class LaunchResult:
    run_dir: Path
    statuses: list[dict] = field(default_factory=list)  # stage<k>.json of every stage
    wall_s: float = 0.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def worker_env(
    rank: int,
    world_size: int,
    port: int,
    run_dir: Path,
    heartbeat_timeout: float | None = None,
    master_addr: str = "127.0.0.1",
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(port),
        **{RUN_DIR_ENV: str(run_dir), HEARTBEAT_TIMEOUT_ENV: str(heartbeat_timeout_s(heartbeat_timeout))},
    )
    return env


def spawn_worker(
    rank: int,
    world_size: int,
    port: int,
    run_dir: Path,
    options_file: Path,
    heartbeat_timeout: float | None = None,
    listener: socket.socket | None = None,
) -> subprocess.Popen:
    """Stage `rank` as a child process; `heartbeat_timeout`: seconds (None: the env's or 30 s);
    `listener`: the socket bound to `port` that stage 0 inherits for the group's store."""
    env = worker_env(rank, world_size, port, run_dir, heartbeat_timeout)
    if listener is not None:
        env[MASTER_LISTEN_FD_ENV] = str(listener.fileno())
    log = open(run_dir / f"stage{rank}.log", "wb")  # noqa: SIM115 - the child owns it
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "tessel.pipeline.stage.worker", "--options", str(options_file)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=() if listener is None else (listener.fileno(),),
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
        )
    finally:
        log.close()


def read_status(run_dir: Path, rank: int) -> dict:
    path = run_dir / f"stage{rank}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"stage": rank}


def failure_cause(run_dir: Path, rank: int, returncode: int) -> tuple[int, str]:
    """(priority, cause) of a stage that exited with `returncode`; lower priority = root cause."""
    return failure_cause_of(returncode, read_status(run_dir, rank), _log_tail(run_dir, rank))


def failure_cause_of(returncode: int, status: dict, log_tail: str) -> tuple[int, str]:
    """(priority, cause) of a stage that exited with `returncode`, from its status and its log's tail."""
    if returncode < 0:
        name = (
            signal.Signals(-returncode).name
            if -returncode in signal.Signals._value2member_map_
            else -returncode
        )
        cause = f"killed by signal {name}"
        if returncode == -signal.SIGKILL:
            cause += " (SIGKILL: killed by hand or by the kernel's out-of-memory killer)"
        return 0, cause
    if status.get("error"):
        priority = 2 if status.get("kind") == "peer" else 1
        return priority, str(status["error"])
    return 1, f"exited with code {returncode}: {log_tail or '(empty log)'}"


def _log_tail(run_dir: Path, rank: int, lines: int = 3) -> str:
    try:
        text = (run_dir / f"stage{rank}.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"


def terminate(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (and SIGCONT, so a stopped process gets it), then SIGKILL after `TERMINATE_GRACE_S`."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
                proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


def supervise(
    procs: list[subprocess.Popen], run_dir: Path, first_rank: int = 0, watchdog: Watchdog | None = None
) -> None:
    """Return when every process exited 0; else stop them all and raise `StageFailedError`."""
    done_at = None
    watched_at = time.monotonic()
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            if all(code == 0 for code in codes):
                return
            if any(code not in (None, 0) for code in codes):
                _fail(procs, run_dir, first_rank)
            if watchdog is not None and time.monotonic() - watched_at >= WATCHDOG_INTERVAL_S:
                watched_at = time.monotonic()
                silent = watchdog.check(
                    lambda rank: procs[rank - first_rank].poll() is None,
                    lambda rank: procs[rank - first_rank].pid,
                )
                if silent is not None:
                    terminate(procs)
                    raise StageFailedError(*silent)
            if codes[0] == 0 and done_at is None:
                done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at > DONE_GRACE_S:
                late = [first_rank + i for i, code in enumerate(codes) if code is None]
                terminate(procs)
                raise StageFailedError(late[0], f"did not exit {DONE_GRACE_S:.0f} s after stage 0 finished")
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        terminate(procs)
        raise TesselError(f"interrupted: stopped all {len(procs)} stage processes", exit_code=130) from None
    except BaseException:
        terminate(procs)
        raise


def _fail(procs: list[subprocess.Popen], run_dir: Path, first_rank: int) -> None:
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(POLL_S)
    causes = [
        (*failure_cause(run_dir, first_rank + i, proc.returncode), first_rank + i)
        for i, proc in enumerate(procs)
        if proc.returncode not in (None, 0)
    ]
    terminate(procs)
    priority, cause, stage = min(causes, key=lambda c: (c[0], c[2]))
    raise StageFailedError(stage, cause)


class FirstFailure(abc.ABC):
    """The first failure of a set of stages, kept: every caller of `failure` gets the same one, from
    any thread, and stopping the stages afterwards (or a stage this object stopped) never changes
    it. A subclass finds failures (`_find_failure`) and sets `_stopped` when it stops its stages."""

    def __init__(self) -> None:
        self._failure: StageFailedError | None = None
        self._stopped = False
        self._lock = threading.Lock()  # the watcher and the engine thread both ask `failure()`

    @abc.abstractmethod
    def _find_failure(self) -> StageFailedError | None:
        """A failure of the stages now, or None (called under the lock until one is found)."""

    def failure(self, settle_s: float = 0.0) -> StageFailedError | None:
        """The failure of a stage that exited (waiting up to `settle_s` for one to), died with its
        machine or fell silent, or None."""
        deadline = time.monotonic() + settle_s
        while True:
            with self._lock:
                if self._failure is None and not self._stopped:
                    self._failure = self._find_failure()
                found = self._failure
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(POLL_S)


class LocalStages(FirstFailure):
    """Stages 1..S-1 as child processes of a process that is itself stage 0 (`tessel serve --plan`).

    `stage0_progress`: stage 0's `StageProgress` (its `StageComm`'s), set once the process group is up,
    so the watchdog also sees a stuck pipeline. The first failure found is kept: stopping the
    others afterwards does not change the cause reported.
    """

    def __init__(
        self,
        options_file: Path,
        num_stages: int,
        run_dir: Path,
        port: int,
        heartbeat_timeout: float | None = None,
    ) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        timeout_s = heartbeat_timeout_s(heartbeat_timeout)
        self.procs: list[subprocess.Popen] = []
        self.stage0_progress: StageProgress | None = None
        self.watchdog = Watchdog(
            run_dir, list(range(1, num_stages)), timeout_s, time.time(), lambda: self.stage0_progress
        )
        super().__init__()
        try:
            for rank in range(1, num_stages):
                self.procs.append(spawn_worker(rank, num_stages, port, run_dir, options_file, timeout_s))
        except BaseException:
            terminate(self.procs)
            raise

    def _find_failure(self) -> StageFailedError | None:
        dead = self._exited()
        if dead:  # a stage that lost its peer exits a moment after the one that died: the root cause
            settle = time.monotonic() + SETTLE_S
            while time.monotonic() < settle and len(dead) < len(self.procs):
                time.sleep(POLL_S)
                dead = self._exited()
            causes = [(*failure_cause(self.run_dir, rank, code), rank) for rank, code in dead]
            _, cause, stage = min(causes, key=lambda c: (c[0], c[2]))
            return StageFailedError(stage, cause)
        silent = self.watchdog.check(
            lambda rank: self.procs[rank - 1].poll() is None, lambda rank: self.procs[rank - 1].pid
        )
        return None if silent is None else StageFailedError(*silent)

    def _exited(self) -> list[tuple[int, int]]:
        return [(i + 1, p.returncode) for i, p in enumerate(self.procs) if p.poll() is not None]

    def wait_loaded(self, timeout_s: float | None = None) -> None:
        """Wait until every stage has loaded its layers (its status says so); raises the
        `StageFailedError` of a stage that died (out of memory, ...) or fell silent meanwhile, and a
        TimeoutError after `timeout_s` (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not all(read_status(self.run_dir, r).get("state") in ("loaded", "ready") for r in self.ranks):
            failure = self.failure()
            if failure is not None:
                raise failure
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the new stages did not load their layers within {timeout_s:g} s")
            time.sleep(POLL_S)

    @property
    def ranks(self) -> range:
        return range(1, len(self.procs) + 1)

    def alive(self, rank: int) -> bool:
        return self.procs[rank - 1].poll() is None

    def beat_age_s(self, rank: int, now: float) -> float | None:
        beat = read_beat(self.run_dir, rank)
        return None if beat is None else max(now - beat.time_s, 0.0)

    def stop(self) -> None:
        """Terminate every stage process; their exits are not failures to report."""
        with self._lock:
            self._stopped = True
            terminate(self.procs)


def launch(
    options_file: Path, num_stages: int, run_dir: Path, heartbeat_timeout: float | None = None
) -> LaunchResult:
    """Run `python -m tessel.pipeline.stage.worker ARGV` as `num_stages` stages; -> their statuses.

    `heartbeat_timeout`: seconds a stage may stay silent (None: `TESSEL_HEARTBEAT_TIMEOUT_S` or 30)."""
    timeout_s = heartbeat_timeout_s(heartbeat_timeout)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    procs: list[subprocess.Popen] = []
    with reserve_port("127.0.0.1") as listener:  # stage 0 inherits it: the port is never free meanwhile
        port = port_of(listener)
        try:
            for rank in range(num_stages):
                held = listener if rank == 0 else None
                procs.append(spawn_worker(rank, num_stages, port, run_dir, options_file, timeout_s, held))
        except BaseException:
            terminate(procs)
            raise
    supervise(procs, run_dir, watchdog=Watchdog(run_dir, list(range(num_stages)), timeout_s, started))
    return LaunchResult(run_dir, [read_status(run_dir, r) for r in range(num_stages)], time.time() - started)
