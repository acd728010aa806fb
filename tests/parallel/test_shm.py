"""The shared-memory all-reduce: every rank gets the rank-order sum, call after call (both slot
sets), and a dead peer raises instead of spinning forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tessel.parallel import shm
from tessel.parallel.shm import PEER_CHECK_S, SLOT_BYTES, PeerGoneError, ShmAllReduce, create_segment


def test_ranks_get_the_same_rank_order_sum(tmp_path) -> None:
    path = tmp_path / "segment"
    create_segment(path, 2)
    pids = [os.getpid(), os.getpid()]  # both ranks are threads of this process here
    ranks = [ShmAllReduce(path, r, 2, pids) for r in range(2)]
    inputs = [[torch.randn(n, 7) for n in (1, 5, 33, 2, 9)] for _ in range(2)]
    outputs: list[list[torch.Tensor]] = [[], []]

    def run(rank: int) -> None:
        for t in inputs[rank]:
            outputs[rank].append(ranks[rank].all_reduce(t.clone()))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b, x, y in zip(*outputs, *inputs, strict=True):
        assert torch.equal(a, b) and torch.equal(a, x + y)
    assert not ranks[0].fits(torch.empty(SLOT_BYTES // 4 + 1))


def test_gather_to_the_leader_between_all_reduces(tmp_path) -> None:  # noqa: ANN001
    """Rank 0 gets every rank's columns in rank order (what gloo's gather gives), call after call,
    gathers and all-reduces interleaved on the two slot sets; the others get None."""
    path = tmp_path / "segment"
    create_segment(path, 3)
    ranks = [ShmAllReduce(path, r, 3, [os.getpid()] * 3) for r in range(3)]
    inputs = [[torch.randn(4, n) for n in (5, 1, 7, 3)] for _ in range(3)]
    outputs: list[list] = [[], [], []]

    def run(rank: int) -> None:
        for t in inputs[rank]:
            outputs[rank].append(ranks[rank].gather_to_leader(t))
            outputs[rank].append(ranks[rank].all_reduce(t.clone()))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for call, parts in enumerate(zip(*inputs, strict=True)):
        assert torch.equal(outputs[0][2 * call], torch.cat(parts, dim=-1))
        assert outputs[1][2 * call] is None and outputs[2][2 * call] is None
        assert torch.equal(outputs[0][2 * call + 1], outputs[2][2 * call + 1])


def test_a_dead_peer_raises(tmp_path) -> None:
    path = tmp_path / "segment"
    create_segment(path, 2)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rank = ShmAllReduce(path, 0, 2, [os.getpid(), gone.pid])
    with pytest.raises(PeerGoneError, match=rf"rank 1 \(pid {gone.pid}\) is no longer running"):
        rank.all_reduce(torch.ones(3))
    assert PEER_CHECK_S < 1


def test_a_stopped_peer_raises_after_the_limit(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A peer that stays stopped (SIGSTOP) through the limit raises, naming it; within the limit the
    wait goes on (a resumed peer would finish the call)."""
    monkeypatch.setattr(shm, "STOPPED_LIMIT_S", 0.5)
    path = tmp_path / "segment"
    create_segment(path, 2)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        peer.send_signal(signal.SIGSTOP)
        rank = ShmAllReduce(path, 0, 2, [os.getpid(), peer.pid])
        started = time.perf_counter()
        with pytest.raises(PeerGoneError, match=rf"rank 1 \(pid {peer.pid}\) has been stopped for"):
            rank.all_reduce(torch.ones(3))
        assert time.perf_counter() - started >= 0.5
    finally:
        peer.kill()
        peer.wait()


def test_create_segment_never_overwrites_a_file(tmp_path) -> None:  # noqa: ANN001
    """A file already at the segment's path is someone else's: refused, left as it was."""
    path = tmp_path / "segment"
    path.write_bytes(b"not ours")
    with pytest.raises(FileExistsError):
        create_segment(path, 2)
    assert path.read_bytes() == b"not ours"
