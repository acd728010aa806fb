"""Which stage failed, as `LocalStages` (the stages a server spawns) reports it, with stand-ins for
the processes: the root cause among stages that exit together, one answer for every thread that
asks, and never a stage the supervisor stopped itself (issue 42, finding 10)."""

from __future__ import annotations

import json
import signal
import threading

from tessel.pipeline.supervision import launcher
from tessel.pipeline.supervision.launcher import LocalStages


class FakeProc:
    """A stage process: `codes` are what successive `poll()` calls see (the last one repeats)."""

    def __init__(self, pid: int, codes: list[int | None]) -> None:
        self.pid, self.codes = pid, list(codes)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.codes.pop(0) if len(self.codes) > 1 else self.codes[0]
        return self.returncode

    def terminate(self) -> None:
        if self.poll() is None:
            self.codes, self.returncode = [-signal.SIGTERM], -signal.SIGTERM

    def send_signal(self, sig: int) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int | None:
        return self.poll()

    kill = terminate


def _stages(tmp_path, monkeypatch, codes: dict[int, list[int | None]]) -> LocalStages:
    procs = {rank: FakeProc(1000 + rank, c) for rank, c in codes.items()}
    monkeypatch.setattr(launcher, "spawn_worker", lambda rank, *args: procs[rank])
    monkeypatch.setattr(launcher, "SETTLE_S", 0.5)
    monkeypatch.setattr(launcher, "POLL_S", 0.01)
    return LocalStages([], len(codes) + 1, tmp_path, port=0, heartbeat_timeout=30.0)


def test_stages_the_supervisor_stopped_are_never_the_cause(tmp_path, monkeypatch):
    """A pipeline closed by a remap (its stages terminated): a watcher that asks afterwards finds no
    failure, not 'stage 1 killed by signal SIGTERM'."""
    stages = _stages(tmp_path, monkeypatch, {1: [None], 2: [None]})
    stages.stop()
    assert stages.failure() is None
    assert stages.failure(settle_s=0.1) is None


def test_the_root_cause_is_found_among_stages_that_exit_together(tmp_path, monkeypatch):
    """Stage 2 is killed; stage 1, its peer gone, exits first with 'peer lost': the cause named is
    stage 2's SIGKILL, not the first exit seen."""
    (tmp_path / "stage1.json").write_text(
        json.dumps({"stage": 1, "state": "failed", "kind": "peer", "error": "stage 1: receiving failed"})
    )
    stages = _stages(tmp_path, monkeypatch, {1: [3], 2: [None, None, -signal.SIGKILL]})
    failure = stages.failure()
    assert failure is not None and failure.stage == 2 and "SIGKILL" in failure.cause


def test_every_caller_gets_the_first_failure_found(tmp_path, monkeypatch):
    """The watcher finds stage 2's death and stops the others while the engine thread explains its
    lost peer: both get stage 2 (the stage 1 the watcher's stop killed is not a cause)."""
    stages = _stages(tmp_path, monkeypatch, {1: [None], 2: [None, -signal.SIGKILL]})
    answers: list = []

    def explain() -> None:
        answers.append(stages.failure(settle_s=2.0))

    thread = threading.Thread(target=explain)
    thread.start()
    found = stages.failure(settle_s=2.0)
    stages.stop()
    thread.join(timeout=10)
    assert found is not None and found.stage == 2
    assert [a.stage for a in answers] == [2]
    assert stages.failure().stage == 2


def test_a_stop_never_turns_into_a_later_failure(tmp_path, monkeypatch):
    stages = _stages(tmp_path, monkeypatch, {1: [None], 2: [None], 3: [None]})
    assert stages.failure() is None
    stages.stop()
    assert all(proc.returncode == -signal.SIGTERM for proc in stages.procs)
    assert stages.failure(settle_s=0.05) is None
