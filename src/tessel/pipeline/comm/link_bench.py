"""The link between machines, measured with torch.distributed (`tessel probe` under torchrun).

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST:29500 -m tessel.cli probe --out c.yaml

Every rank probes its own machine (`tessel.catalog.local_machine`), the cluster files are gathered
on rank 0, and rank 0 plays ping-pong with every other rank: a small message for the latency, a
large one for the bandwidth, one way = half the round trip; the network figure is the slowest
pair's (lowest bandwidth, highest latency), since a cluster file gives one network for all pairs.
The backend is NCCL with CUDA tensors where every rank has a GPU (the path hidden states take
between stages), else gloo over TCP.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from tessel.units import BITS_PER_BYTE, US_PER_S

LATENCY_BYTES = 4  # one float32: the round trip is all latency
BANDWIDTH_BYTES = 64 * 2**20  # 64 MiB: well past any link's latency-bandwidth product
REPEATS = 5


@dataclass(frozen=True, slots=True)
class LinkMeasure:
    peer: int
    latency_us: float  # one way
    bandwidth_gbps: float  # gigabits per second, as cluster files give it

    def as_network(self) -> dict:
        return {"bandwidth_gbps": round(self.bandwidth_gbps, 3), "latency_us": round(self.latency_us, 2)}


def _round_trip_s(dist, tensor, rank: int, peer: int, repeats: int, group, first: int = 0) -> float:  # noqa: ANN001
    """Best round trip of `tensor` between rank `first` and `peer` (other ranks wait at the barrier)."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms the connection up
        begin = time.perf_counter()
        if rank == first:
            dist.send(tensor, dst=peer, group=group)
            dist.recv(tensor, src=peer, group=group)
        elif rank == peer:
            dist.recv(tensor, src=first, group=group)
            dist.send(tensor, dst=first, group=group)
        _synchronize(tensor)
        best = min(best, time.perf_counter() - begin)
    return best


def _synchronize(tensor) -> None:  # noqa: ANN001
    if tensor.is_cuda:
        import torch

        torch.cuda.synchronize(tensor.device)


def measure_links(
    device: str = "cpu",
    *,
    bandwidth_bytes: int = BANDWIDTH_BYTES,
    repeats: int = REPEATS,
    group=None,  # noqa: ANN001
) -> list[LinkMeasure]:
    """Rank 0's links to every other rank of the initialised process group (`group`: another group
    over the same ranks, e.g. NCCL's); rank 0 gets them, other ranks an empty list."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    small = torch.zeros(LATENCY_BYTES // 4, device=device)
    large = torch.zeros(bandwidth_bytes // 4, device=device)
    found = []
    for peer in range(1, world):
        latency_s = _round_trip_s(dist, small, rank, peer, repeats, group) / 2
        one_way_s = _round_trip_s(dist, large, rank, peer, repeats, group) / 2
        dist.barrier(group=group)
        if rank == 0:
            # the large message's whole one-way time (its latency included: a few us of many ms)
            gbps = bandwidth_bytes * BITS_PER_BYTE / max(one_way_s, 1e-9) / 1e9
            found.append(LinkMeasure(peer, latency_s * US_PER_S, gbps))
    return found


def measure_pairs(
    pairs: list[tuple[int, int]], *, bandwidth_bytes: int = BANDWIDTH_BYTES, repeats: int = REPEATS
) -> list[tuple[int, int, LinkMeasure]]:
    """Every pair (a, b)'s link over the initialised gloo process group, one pair at a time (the
    others wait at a barrier); every rank gets the list, in `pairs` order."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    small = torch.zeros(LATENCY_BYTES // 4)
    large = torch.zeros(bandwidth_bytes // 4)
    found = []
    for a, b in pairs:
        latency_s = _round_trip_s(dist, small, rank, b, repeats, None, first=a) / 2
        one_way_s = _round_trip_s(dist, large, rank, b, repeats, None, first=a) / 2
        measured = torch.tensor([latency_s, one_way_s], dtype=torch.float64)
        dist.broadcast(measured, src=a)
        latency_s, one_way_s = measured.tolist()
        gbps = bandwidth_bytes * BITS_PER_BYTE / max(one_way_s, 1e-9) / 1e9
        found.append((a, b, LinkMeasure(b, latency_s * US_PER_S, gbps)))
    return found


def slowest(links: list[LinkMeasure]) -> dict:
    """The one network figure for a cluster file: the lowest bandwidth and the highest latency."""
    return {
        "bandwidth_gbps": round(min(link.bandwidth_gbps for link in links), 3),
        "latency_us": round(max(link.latency_us for link in links), 2),
    }


def probe_over_torchrun(
    cluster: dict,
    *,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    bandwidth_bytes: int = BANDWIDTH_BYTES,
) -> tuple[dict | None, list[LinkMeasure], list[str]]:
    """On every rank: gather each machine's cluster mapping, measure rank 0's links, and merge.
    Rank 0 gets (merged cluster, links, notes); other ranks (None, [], [])."""
    import torch
    import torch.distributed as dist

    from tessel.plan.files.cluster_merge import merge_clusters

    has_gpu = torch.cuda.is_available()
    device = "cpu"
    kwargs = {"init_method": init_method} if init_method else {}
    if rank is not None:
        kwargs |= {"rank": rank, "world_size": world_size}
    dist.init_process_group("gloo", **kwargs)
    try:
        host = socket.gethostname()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (host, cluster, has_gpu))
        group = None
        if all(item[2] for item in gathered):
            device = f"cuda:{torch.cuda.current_device()}"
            group = dist.new_group(backend="nccl")
        links = measure_links(device, group=group, bandwidth_bytes=bandwidth_bytes)
        if dist.get_rank() != 0:
            return None, [], []
        parts = [(h, f"rank {k} ({h})", data) for k, (h, data, _) in enumerate(gathered)]
        merged, notes = merge_clusters(parts, network=slowest(links), name="torchrun")
        return merged, links, notes
    finally:
        dist.destroy_process_group()
