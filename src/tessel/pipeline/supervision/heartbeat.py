"""Stage liveness: a heartbeat thread in every stage process, and the watchdog that reads them.

A stage the launcher spawns runs a daemon thread that rewrites `stage<k>.beat` in the run
directory every `beat_interval_s(timeout)` with the time and the stage's `StageProgress`, from the
first lines of the process (`tessel.pipeline.stage.worker` starts it before importing torch) to its end.
The progress names the stage's phase: `starting` (importing torch and the runtime), `loading` (its
layers), `joining` (the process group) and `serving`. The launcher's `Watchdog` fails the run when

- a stage sent no heartbeat for `timeout_s` ("stage 1 sent no heartbeat for 30 s while loading"):
  the process is stopped (SIGSTOP, a debugger), frozen or starved. A stopped process stops all its
  threads, so the beat stops with it; a process that died is found by its exit code first. While a
  stage is `starting` the allowance is at least `STARTING_SILENCE_S` (an extension module's import
  may hold the interpreter's lock for seconds on a loaded machine), and before its first beat it has
  `STARTUP_TIMEOUT_S` (the interpreter starting);
- a stage's process is stopped (state `T` in `/proc/<pid>/stat`: SIGSTOP, a debugger) for
  `timeout_s`, whatever its beats say: a stage stopped before its first beat is found too;
- every stage has loaded and one has been joining the process group for `JOIN_STALL_S` (or the
  timeout, if longer) since the last one got there: a stuck rendezvous or NCCL init, which the
  beat alone cannot see (the thread beats on while the main thread waits in the join);
- the pipeline made no progress for `timeout_s` while work is owed: stage 0 has waited that long
  for a micro-batch's tokens and no stage has computed or moved anything since. That is a deadlock
  or a stuck collective, which a thread heartbeat alone cannot see (the thread beats on while the
  main thread waits in a receive). StageProgress is judged only while stage 0 waits for tokens and never
  while a stage computes, so a long prefill, an emulated slow stage or an idle server (later stages
  waiting for work for hours) is never mistaken for a hang. The stage named is the first that has
  not handed the owed micro-batch on.

The timeout is `--heartbeat-timeout` or `TESSEL_HEARTBEAT_TIMEOUT_S` (default 30 s); the stage
processes get it in their environment and beat five times per timeout (at most once a second).
This module imports no torch: the launcher side stays light.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tessel.errors import TesselError

HEARTBEAT_TIMEOUT_ENV = "TESSEL_HEARTBEAT_TIMEOUT_S"
RUN_DIR_ENV = "TESSEL_RUN_DIR"  # where a launched stage writes its status, beat and log
MASTER_LISTEN_FD_ENV = "TESSEL_MASTER_LISTEN_FD"  # stage 0's inherited socket on MASTER_PORT (tessel.ports)
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
MIN_HEARTBEAT_TIMEOUT_S = 0.5  # several beats must fit in it
MAX_HEARTBEAT_TIMEOUT_S = 24 * 3600.0  # a day: a stage silent for longer is not coming back
MAX_BEAT_INTERVAL_S = 1.0
BEATS_PER_TIMEOUT = 5
STARTUP_TIMEOUT_S = 60.0  # before a stage's first beat: the interpreter starting, on a loaded machine
STARTING_SILENCE_S = 30.0  # least silence allowed while a stage imports torch (the import may hold the GIL)
PHASES = ("starting", "loading", "joining", "serving")
JOIN_STALL_S = 120.0  # joining is a handshake once every stage has loaded: seconds, never minutes


def heartbeat_timeout_s(value: float | None = None) -> float:
    """`value` (an option), else `TESSEL_HEARTBEAT_TIMEOUT_S`, else 30 s; a number of seconds in
    [MIN_HEARTBEAT_TIMEOUT_S, MAX_HEARTBEAT_TIMEOUT_S]."""
    source = "--heartbeat-timeout"
    if value is None:
        text = os.environ.get(HEARTBEAT_TIMEOUT_ENV)
        if text is None:
            return DEFAULT_HEARTBEAT_TIMEOUT_S
        source = HEARTBEAT_TIMEOUT_ENV
        try:
            value = float(text)
        except ValueError:
            raise TesselError(f"{source}={text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and MIN_HEARTBEAT_TIMEOUT_S <= value <= MAX_HEARTBEAT_TIMEOUT_S):
        raise TesselError(
            f"{source} must be a number of seconds in [{MIN_HEARTBEAT_TIMEOUT_S:g}, "
            f"{MAX_HEARTBEAT_TIMEOUT_S:g}], got {value}"
        )
    return float(value)


def beat_interval_s(timeout_s: float) -> float:
    return min(MAX_BEAT_INTERVAL_S, timeout_s / BEATS_PER_TIMEOUT)


def beat_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"stage{rank}.beat"


@dataclass(slots=True)
class StageProgress:
    """What a stage's main thread is doing: its phase (`PHASES`), and, once serving, what its
    `StageComm` sets as messages move (wall times)."""

    phase: str = (
        "serving"  # a stage process starts its heartbeat with "starting" (`tessel.pipeline.stage.worker`)
    )
    phase_since: float = field(default_factory=time.time)
    last_s: float = field(default_factory=time.time)  # the last time work moved through this stage
    active_since: float | None = None  # computing a received micro-batch since (stages >= 1)
    last_batch: int = -1  # the last micro-batch this stage handed on (stage 0: got the tokens of)
    owed_since: float | None = None  # stage 0: waiting for the tokens of `owed_batch` since
    owed_batch: int | None = None
    # what the stage computed so far (`StageRunner.account`): the remap watcher's step times
    batches: int = 0
    tokens: int = 0
    busy_s: float = 0.0  # compute + emulation sleep


@dataclass(slots=True)
class Beat:
    """One stage's last heartbeat as the watchdog reads it."""

    time_s: float
    progress: StageProgress


class Heartbeat:
    """A daemon thread writing `stage<rank>.beat` every `interval_s` until `stop()`."""

    def __init__(self, run_dir: Path, rank: int, interval_s: float, progress: StageProgress) -> None:
        self.path = beat_path(run_dir, rank)
        self.interval_s = interval_s
        self.progress = progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tessel-heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def beat(self) -> None:
        tmp = self.path.with_suffix(".beat-tmp")
        try:
            tmp.write_text(json.dumps({"time_s": time.time(), "progress": asdict(self.progress)}))
            tmp.replace(self.path)
        except OSError:
            pass  # the run directory is gone: the launcher is gone too, and this process with it

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()


def _while(beat: Beat | None) -> str:
    """Where the stage was, as its last beat said ("while loading its layers")."""
    if beat is None:
        return "before its first heartbeat"
    return {
        "starting": "while starting (importing torch)",
        "loading": "while loading its layers",
        "joining": "while joining the process group",
        "serving": "while serving",
    }.get(beat.progress.phase, f"in phase {beat.progress.phase!r}")


def process_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T, or t: traced) as Linux's /proc says; False where
    it cannot be read (gone, another OS)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return False
    state = text.rpartition(")")[2].split()[:1]  # the name may hold spaces and parentheses
    return state in (["T"], ["t"])


def read_beat(run_dir: Path, rank: int) -> Beat | None:
    try:
        data = json.loads(beat_path(run_dir, rank).read_text())
        return Beat(float(data["time_s"]), StageProgress(**data["progress"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not written yet (or being replaced: read again at the next poll)


@dataclass(slots=True)
class Watchdog:
    """Finds a silent stage or a stuck pipeline from the beat files of `ranks` in `run_dir`.

    `stage0`: stage 0's progress when stage 0 is this process (`tessel serve --plan`), not a beat
    file. `started_s`: when the stages were spawned (the start of their startup allowance).
    """

    run_dir: Path
    ranks: list[int]
    timeout_s: float
    started_s: float
    stage0: Callable[[], StageProgress | None] | None = None
    read: Callable[[Path, int], Beat | None] = read_beat  # a stage's last beat (remote stages: reported)

    _stopped_since: dict[int, float] = field(default_factory=dict)  # rank -> first seen stopped

    def check(
        self, running: Callable[[int], bool], pid_of: Callable[[int], int | None] | None = None
    ) -> tuple[int, str] | None:
        """(stage, cause) of the first stage found stopped, silent or stuck among those `running`, or
        None; `pid_of`: a stage's process id, to read its state (None: beats alone)."""
        now = time.time()
        beats: dict[int, Beat | None] = {}
        for rank in self.ranks:
            if not running(rank):
                continue
            beat = beats[rank] = self.read(self.run_dir, rank)
            cause = self._stopped(rank, pid_of(rank) if pid_of else None, beat, now)
            cause = cause or self._silent(beat, now)
            if cause is not None:
                return rank, cause
        return self._joining_stalled(beats, now) or self._stuck(beats, now)

    def _stopped(self, rank: int, pid: int | None, beat: Beat | None, now: float) -> str | None:
        if pid is None or not process_stopped(pid):
            self._stopped_since.pop(rank, None)
            return None
        since = self._stopped_since.setdefault(rank, now)
        if now - since <= self.timeout_s:
            return None
        return f"is stopped (SIGSTOP or a debugger) for {self.timeout_s:g} s {_while(beat)}"

    def _silent(self, beat: Beat | None, now: float) -> str | None:
        if beat is None:
            if now - self.started_s > max(STARTUP_TIMEOUT_S, self.timeout_s):
                return f"sent no heartbeat in the {now - self.started_s:.0f} s since it started"
            return None
        allowed_s = self.timeout_s
        if beat.progress.phase == "starting":
            allowed_s = max(allowed_s, STARTING_SILENCE_S)
        if now - beat.time_s > allowed_s:
            return (
                f"sent no heartbeat for {allowed_s:g} s {_while(beat)} (the process is stopped, frozen or "
                "starved of CPU; a SIGSTOP, a debugger)"
            )
        return None

    def _joining_stalled(self, beats: dict[int, Beat | None], now: float) -> tuple[int, str] | None:
        """(stage, cause) when every stage is past loading and one has joined for too long."""
        progress = [beat.progress for beat in beats.values() if beat is not None]
        if self.stage0 is not None:
            progress.append(self.stage0() or StageProgress(phase="loading"))  # unknown: not past loading
        if len(progress) < len(beats) + (self.stage0 is not None) or any(
            p.phase not in ("joining", "serving") for p in progress
        ):
            return None
        joining = [(rank, b.progress) for rank, b in beats.items() if b and b.progress.phase == "joining"]
        if not joining:
            return None
        since = max(p.phase_since for p in progress if p.phase == "joining")
        allowed_s = max(self.timeout_s, JOIN_STALL_S)
        if now - since <= allowed_s:
            return None
        rank, stalled = joining[0]
        return rank, (
            f"has been joining the process group for {now - stalled.phase_since:.0f} s, {allowed_s:g} s "
            "after every stage had loaded (a stuck rendezvous or NCCL init)"
        )

    def _stuck(self, beats: dict[int, Beat | None], now: float) -> tuple[int, str] | None:
        progress = {rank: beat.progress for rank, beat in beats.items() if beat is not None}
        if self.stage0 is not None:
            first = self.stage0()
            if first is not None:
                progress[0] = first
        first = progress.get(0)
        if first is None or first.owed_since is None or now - first.owed_since <= self.timeout_s:
            return None
        others = sorted(rank for rank in progress if rank != 0)
        if set(progress) != {*self.ranks, *([0] if self.stage0 is not None else [])}:
            return None  # a stage not yet heard from, or exited: its exit code tells
        for rank in others:
            p = progress[rank]
            if p.active_since is not None or now - p.last_s <= self.timeout_s:
                return None  # a stage is computing or moved something recently: not stuck
        batch = first.owed_batch
        waited = f"stage 0 has waited {now - first.owed_since:.0f} s for the tokens of micro-batch {batch}"
        for rank in others:
            if batch is not None and progress[rank].last_batch < batch:
                return rank, (
                    f"made no progress: {waited} and stage {rank} never handed it on (it waits to receive "
                    f"it from stage {rank - 1}: a lost message or a stuck collective)"
                )
        return (
            0,
            f"made no progress: {waited}, which every stage handed on (a lost message or a stuck receive)",
        )
