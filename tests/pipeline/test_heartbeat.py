"""The watchdog's rules on written beat files (no processes): a silent stage, a stuck pipeline, and
what must not count as either (an idle server, a long computation, a stage still starting)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tessel.errors import TesselError
from tessel.pipeline.supervision.heartbeat import (
    JOIN_STALL_S,
    STARTING_SILENCE_S,
    Heartbeat,
    StageProgress,
    Watchdog,
    beat_interval_s,
    beat_path,
    heartbeat_timeout_s,
    process_stopped,
    read_beat,
)

TIMEOUT_S = 10.0


def _beat(run_dir, rank: int, progress: StageProgress, age_s: float = 0.0) -> None:
    """Write stage `rank`'s beat as if it was sent `age_s` ago."""
    beat = {"time_s": time.time() - age_s, "progress": dataclasses.asdict(progress)}
    beat_path(run_dir, rank).write_text(json.dumps(beat))


def _watchdog(run_dir, ranks=(0, 1, 2), started_ago_s: float = 0.0) -> Watchdog:
    return Watchdog(run_dir, list(ranks), TIMEOUT_S, time.time() - started_ago_s)


def _all_running(rank: int) -> bool:
    return True


def test_the_thread_beats_with_the_progress_it_holds(tmp_path):
    progress = StageProgress(last_batch=3)
    heartbeat = Heartbeat(tmp_path, 1, 0.02, progress).start()
    try:
        first = read_beat(tmp_path, 1)
        assert first is not None and first.progress.last_batch == 3
        progress.last_batch = 4
        deadline = time.monotonic() + 10
        while (beat := read_beat(tmp_path, 1)) is None or beat.progress.last_batch != 4:
            assert time.monotonic() < deadline, "the heartbeat thread did not beat again"
            time.sleep(0.02)
        assert beat.time_s > first.time_s
    finally:
        heartbeat.stop()


def test_a_silent_stage_is_named(tmp_path):
    for rank in (0, 2):
        _beat(tmp_path, rank, StageProgress())
    _beat(tmp_path, 1, StageProgress(), age_s=TIMEOUT_S + 1)
    stage, cause = _watchdog(tmp_path).check(_all_running)
    assert stage == 1 and cause.startswith(f"sent no heartbeat for {TIMEOUT_S:g} s")
    # a stage that exited is judged by its exit code, not its old beat file
    assert _watchdog(tmp_path).check(lambda rank: rank != 1) is None


def test_a_stage_not_yet_beating_has_the_startup_allowance(tmp_path):
    _beat(tmp_path, 0, StageProgress())
    _beat(tmp_path, 2, StageProgress())
    assert _watchdog(tmp_path, started_ago_s=TIMEOUT_S * 3).check(_all_running) is None
    stage, cause = _watchdog(tmp_path, started_ago_s=10_000).check(_all_running)
    assert stage == 1 and "sent no heartbeat in the" in cause


def _stuck_progress(now: float, owed_batch: int = 7) -> dict[int, StageProgress]:
    long_ago = now - TIMEOUT_S - 5
    return {
        0: StageProgress(
            last_s=long_ago, owed_since=long_ago, owed_batch=owed_batch, last_batch=owed_batch - 1
        ),
        1: StageProgress(last_s=long_ago, last_batch=7),
        2: StageProgress(last_s=long_ago, last_batch=6),
    }


def test_a_stuck_pipeline_names_the_stage_that_never_handed_the_batch_on(tmp_path):
    """Every thread beats, but stage 0 has waited past the timeout for micro-batch 7 and no stage
    moved anything: stage 2 never got it (stage 1 handed it on)."""
    for rank, progress in _stuck_progress(time.time()).items():
        _beat(tmp_path, rank, progress)
    stage, cause = _watchdog(tmp_path).check(_all_running)
    assert stage == 2
    assert "made no progress" in cause and "micro-batch 7" in cause and "stuck collective" in cause


def test_every_stage_handed_it_on_names_stage_0(tmp_path):
    for rank, progress in _stuck_progress(time.time(), owed_batch=5).items():
        _beat(tmp_path, rank, progress)
    assert _watchdog(tmp_path).check(_all_running)[0] == 0


@pytest.mark.parametrize(
    "change",
    [
        lambda p, now: setattr(p[2], "active_since", now - 1000),  # a long computation
        lambda p, now: setattr(p[1], "last_s", now - 1),  # something moved a moment ago
        lambda p, now: setattr(p[0], "owed_since", None),  # nothing owed: an idle server
        lambda p, now: setattr(p[0], "owed_since", now - 1),  # owed, but not for long
    ],
)
def test_not_stuck(tmp_path, change):
    now = time.time()
    progress = _stuck_progress(now)
    change(progress, now)
    for rank, p in progress.items():
        _beat(tmp_path, rank, p)
    assert _watchdog(tmp_path).check(_all_running) is None


def test_stage_0_in_process_counts_in_the_stuck_rule(tmp_path):
    """`tessel serve --plan`: stage 0 is the watching process; its progress comes from memory."""
    progress = _stuck_progress(time.time())
    for rank in (1, 2):
        _beat(tmp_path, rank, progress[rank])
    watchdog = Watchdog(tmp_path, [1, 2], TIMEOUT_S, time.time(), lambda: progress[0])
    assert watchdog.check(_all_running)[0] == 2
    progress[0].owed_since = None
    assert watchdog.check(_all_running) is None


@pytest.mark.parametrize(
    ("phase", "where"),
    [("loading", "while loading its layers"), ("joining", "while joining"), ("serving", "while serving")],
)
def test_silence_names_the_phase(tmp_path, phase, where):
    _beat(tmp_path, 1, StageProgress(phase=phase), age_s=TIMEOUT_S + 1)
    stage, cause = _watchdog(tmp_path, ranks=(1,)).check(_all_running)
    assert stage == 1 and where in cause


def test_a_stage_importing_torch_has_a_longer_silence_allowance(tmp_path):
    """An extension module's import may hold the interpreter lock for seconds: while `starting`, the
    silence allowed is at least STARTING_SILENCE_S, never unbounded."""
    _beat(tmp_path, 1, StageProgress(phase="starting"), age_s=TIMEOUT_S + 1)
    assert _watchdog(tmp_path, ranks=(1,)).check(_all_running) is None
    _beat(tmp_path, 1, StageProgress(phase="starting"), age_s=STARTING_SILENCE_S + 1)
    stage, cause = _watchdog(tmp_path, ranks=(1,)).check(_all_running)
    assert stage == 1 and "while starting" in cause


def test_a_stuck_join_is_named_once_every_stage_has_loaded(tmp_path):
    """The beat thread goes on while the main thread waits in the rendezvous: once every stage is
    past loading, a join older than JOIN_STALL_S is a stuck rendezvous or NCCL init."""
    long_ago = time.time() - JOIN_STALL_S - 5
    _beat(tmp_path, 1, StageProgress(phase="joining", phase_since=long_ago))
    _beat(tmp_path, 2, StageProgress(phase="loading", phase_since=long_ago))
    assert _watchdog(tmp_path, ranks=(1, 2)).check(_all_running) is None  # stage 2 still loads
    _beat(tmp_path, 2, StageProgress(phase="joining", phase_since=long_ago))
    stage, cause = _watchdog(tmp_path, ranks=(1, 2)).check(_all_running)
    assert stage == 1 and "joining the process group" in cause
    _beat(tmp_path, 2, StageProgress(phase="joining", phase_since=time.time()))  # the last just got there
    assert _watchdog(tmp_path, ranks=(1, 2)).check(_all_running) is None


def _until(condition, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "the process never reached the state"
        time.sleep(0.01)


def test_a_stopped_process_is_found_before_its_first_beat(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        _until(lambda: process_stopped(proc.pid))  # the signal is delivered asynchronously
        watchdog = _watchdog(tmp_path, ranks=(1,))
        assert watchdog.check(_all_running, lambda rank: proc.pid) is None  # seen stopped: the clock starts
        watchdog._stopped_since[1] -= TIMEOUT_S + 1
        stage, cause = watchdog.check(_all_running, lambda rank: proc.pid)
        assert stage == 1 and "is stopped" in cause and "before its first heartbeat" in cause
        os.kill(proc.pid, signal.SIGCONT)
        _until(lambda: not process_stopped(proc.pid))
        assert watchdog.check(_all_running, lambda rank: proc.pid) is None
    finally:
        proc.kill()
        proc.wait()


def test_timeout_from_option_env_and_default(monkeypatch):
    monkeypatch.delenv("TESSEL_HEARTBEAT_TIMEOUT_S", raising=False)
    assert heartbeat_timeout_s() == 30.0
    monkeypatch.setenv("TESSEL_HEARTBEAT_TIMEOUT_S", "2.5")
    assert heartbeat_timeout_s() == 2.5 and heartbeat_timeout_s(7) == 7.0
    assert beat_interval_s(2.5) == 0.5 and beat_interval_s(30) == 1.0
    for bad in ("nan", "0.1", "-3", "inf", "1e300"):
        monkeypatch.setenv("TESSEL_HEARTBEAT_TIMEOUT_S", bad)
        with pytest.raises(TesselError, match="TESSEL_HEARTBEAT_TIMEOUT_S"):
            heartbeat_timeout_s()
