"""The TP group over gloo alone (the path of tensors too large for the shared-memory slots, and of
every collective where /dev/shm is missing): sum, max, gather to the leader, broadcast, stop."""

from __future__ import annotations

import threading

import torch

from tessel.parallel.group import join_tp_group
from tessel.pipeline.supervision.launcher import free_port


def test_gloo_collectives_between_two_ranks() -> None:
    port = free_port()
    x = [torch.tensor([1.0, -5.0, 3.0]), torch.tensor([2.0, 4.0, -1.0])]
    results: list = [None, None]

    def run(rank: int) -> None:
        group = join_tp_group(rank, 2, torch.device("cpu"), "127.0.0.1", port, shm=False)
        assert group.shm is None
        total = group.all_reduce(x[rank].clone())
        top = group.all_reduce_max(x[rank].clone())
        gathered = group.gather_to_leader(x[rank].view(1, 3).clone())
        payload = group.broadcast_bytes(torch.arange(5, dtype=torch.uint8) if rank == 0 else None)
        stop = group.broadcast_bytes(None)
        results[rank] = (total, top, gathered, payload, stop)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for total, top, _, payload, stop in results:
        assert torch.equal(total, x[0] + x[1]) and torch.equal(top, torch.maximum(x[0], x[1]))
        assert torch.equal(payload, torch.arange(5, dtype=torch.uint8)) and stop is None
    assert torch.equal(results[0][2], torch.cat(x).view(1, 6)) and results[1][2] is None


def test_no_shared_memory_all_reduce_off_x86(monkeypatch) -> None:  # noqa: ANN001
    """The shared-memory all-reduce relies on x86's store order: elsewhere (an ARM host) gloo."""
    monkeypatch.setattr("tessel.parallel.group.platform.machine", lambda: "aarch64")
    port = free_port()
    groups: list = [None, None]

    def run(rank: int) -> None:
        groups[rank] = join_tp_group(rank, 2, torch.device("cpu"), "127.0.0.1", port)
        groups[rank].all_reduce(torch.ones(3))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(g is not None and g.shm is None for g in groups)
