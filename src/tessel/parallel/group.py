"""The tensor-parallel ranks' process group: all-reduce, gather to the leader, the step broadcast.

The group is built on its own store (`torch.distributed.TCPStore`) and backend objects, not on
torch.distributed's default group, so a process may hold a TP group beside a pipeline's group.
Tensors of the forward (all-reduces, the logits gather) go over NCCL between CUDA ranks and gloo
on the CPU (`tp_backend`); the step's metadata is always a host payload over gloo. A collective
whose peer has died raises (gloo: "Connection closed by peer"); `RankLostError` wraps it.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tessel.errors import TesselError
from tessel.parallel.shm import PeerGoneError, ShmAllReduce, create_segment

# Followers wait for the leader's next step without limit (a server idles for hours); a dead rank
# is noticed by its closed connection and by the executor's watcher, not by this timeout.
TP_TIMEOUT = timedelta(days=7)
JOIN_TIMEOUT = timedelta(seconds=120)  # every rank joins within this (loading comes after)
GATHER_TAG = 45  # the point-to-point tag of the logits gather
SHM_DIR = Path("/dev/shm")
X86_MACHINES = ("x86_64", "AMD64", "i686")  # where stores are seen in program order (TSO)


class RankLostError(RuntimeError):
    """A collective of the tensor-parallel group failed: another rank is gone."""


def tp_backend(device: torch.device) -> str:
    """The backend that carries the forward's tensors on `device`: NCCL between CUDA ranks, gloo on
    the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str, gpus: list[int] | None, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU, or CUDA GPU gpus[rank] (gpus None: GPU `rank`)."""
    if torch.device(device).type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", gpus[rank] if gpus is not None else rank)


def check_gpus(gpus: list[int], degree: int, visible: int, where: str = "the engine") -> None:
    """Refuse, before any process starts, GPU ranks this machine cannot hold: a degree above its GPU
    count, a list of the wrong length, a GPU named twice or one it does not have."""
    if degree > visible:
        raise TesselError(
            f"{where}: tensor-parallel degree {degree} needs {degree} GPUs, this machine has {visible}"
        )
    if len(gpus) != degree:
        raise TesselError(f"{where}: {len(gpus)} GPUs {gpus} named for tensor-parallel degree {degree}")
    twice = sorted({g for g in gpus if gpus.count(g) > 1})
    if twice:
        raise TesselError(
            f"{where}: the tensor-parallel ranks name GPU {', '.join(map(str, twice))} twice ({gpus}); "
            "each rank needs a GPU of its own"
        )
    missing = [g for g in gpus if not 0 <= g < visible]
    if missing:
        raise TesselError(f"{where}: GPU {missing[0]} does not exist here (cuda:0..cuda:{visible - 1})")


@dataclass
class TPGroup:
    rank: int
    degree: int
    device: torch.device
    control: object | None = None  # gloo backend: the step's payloads
    data: object | None = None  # the forward's tensors (`tp_backend`)
    store: object | None = None  # the leader serves it: it lives as long as the group
    shm: ShmAllReduce | None = None  # CPU ranks of one machine: all-reduces through shared memory

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; -> it."""
        return self._reduce(tensor, "sum")

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of `tensor` over the ranks, in place; -> it."""
        return self._reduce(tensor, "max")

    def _reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self.degree == 1:
            return tensor
        if self.shm is not None and self.shm.fits(tensor):
            try:
                return self.shm.all_reduce(tensor, op)
            except PeerGoneError as error:
                raise RankLostError(f"tensor-parallel rank {self.rank}: {error}") from error
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        self._wait(self.data.allreduce([tensor], options))
        return tensor

    def gather_to_leader(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `tensor` [N, C] (same shape everywhere) -> on the leader [N, C * degree] in
        rank order, None on the others."""
        if self.degree == 1:
            return tensor
        tensor = tensor.contiguous()
        if self.shm is not None and self.shm.fits(tensor):
            try:
                return self.shm.gather_to_leader(tensor)
            except PeerGoneError as error:
                raise RankLostError(f"tensor-parallel rank {self.rank}: {error}") from error
        if not self.is_leader:
            self._wait(self.data.send([tensor], 0, GATHER_TAG))
            return None
        parts = [tensor] + [torch.empty_like(tensor) for _ in range(self.degree - 1)]
        for src in range(1, self.degree):
            self._wait(self.data.recv([parts[src]], src, GATHER_TAG))
        return torch.cat(parts, dim=-1)

    def broadcast_bytes(self, payload: torch.Tensor | None) -> torch.Tensor | None:
        """The leader's uint8 `payload` on every rank (None: the stop signal, passed on as None)."""
        size = torch.tensor([-1 if payload is None else payload.numel()], dtype=torch.int64)
        if not self.is_leader:
            size = torch.empty(1, dtype=torch.int64)
        self._wait(self.control.broadcast(size, 0))
        if int(size) < 0:
            return None
        if not self.is_leader:
            payload = torch.empty(int(size), dtype=torch.uint8)
        self._wait(self.control.broadcast(payload, 0))
        return payload

    def _wait(self, work) -> None:  # noqa: ANN001
        try:
            work.wait()
        except RuntimeError as error:
            raise RankLostError(f"tensor-parallel rank {self.rank}: a peer rank is gone ({error})") from error


def join_tp_group(
    rank: int, degree: int, device: torch.device, host: str, port: int, shm: bool = True
) -> TPGroup:
    """Join the group of `degree` ranks whose leader (rank 0) serves the store on host:port; CPU ranks
    all-reduce through shared memory unless `shm` is False (`tessel.parallel.shm`)."""
    if degree == 1:
        return TPGroup(0, 1, device)
    store = dist.TCPStore(host, port, degree, rank == 0, timeout=JOIN_TIMEOUT)
    store.set_timeout(JOIN_TIMEOUT)
    segment = SHM_DIR / f"tessel-tp-{host}-{port}"
    # the shared-memory all-reduce relies on x86 store order (tessel.parallel.shm): elsewhere gloo
    use_shm = shm and device.type == "cpu" and SHM_DIR.is_dir() and platform.machine() in X86_MACHINES
    if use_shm and rank == 0:
        create_segment(segment, degree)
    control = dist.ProcessGroupGloo(dist.PrefixStore("tp/gloo", store), rank, degree, TP_TIMEOUT)
    data = control
    if tp_backend(device) == "nccl":
        torch.cuda.set_device(device)
        data = dist.ProcessGroupNCCL(dist.PrefixStore("tp/nccl", store), rank, degree)
    group = TPGroup(rank, degree, device, control, data, store)
    if use_shm:
        group.shm = _map_segment(store, segment, rank, degree)
    return group


def _map_segment(store, segment: Path, rank: int, degree: int) -> ShmAllReduce:  # noqa: ANN001
    """Every rank maps the leader's segment and learns the others' pids; the leader then unlinks
    the file (the mappings keep it), so nothing is left behind however the ranks end."""
    store.set(f"tp/pid{rank}", str(os.getpid()))
    pids = [int(store.get(f"tp/pid{r}")) for r in range(degree)]
    shm = ShmAllReduce(segment, rank, degree, pids)
    store.set(f"tp/mapped{rank}", "1")
    if rank == 0:
        store.wait([f"tp/mapped{r}" for r in range(degree)])
        segment.unlink()
    return shm
