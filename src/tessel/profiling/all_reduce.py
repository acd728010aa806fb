"""Time the shared-memory all-reduce of CPU tensor-parallel ranks and fit the ring formula to it.

The cost model prices a tensor-parallel stage's all-reduces by the ring formula over its link,
`2(d - 1) * (latency + n / (d * bandwidth))` (`tessel.cost.tensor_parallel`). CPU ranks of one x86
machine all-reduce through shared memory (`tessel.parallel.shm`), which no cluster file or probe
describes: here `degree` processes (this one rank 0) call it in lockstep on tensors of each size, as
a TP stage's layers do, and the formula's two terms are fitted to rank 0's seconds per call (a call
waits for every rank, so this is what a rank pays). Least squares on `t(n) = c0 + c1 * n`, clipped
at zero: latency = c0 / (2(d - 1)), bandwidth = 2(d - 1) / (d * c1).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessel.cost.link import LinkSpec

TOKEN_COUNTS = (1, 8, 32, 128, 512, 2048)  # rows of hidden states per call: decode batches to prefill passes
MIN_CALLS = 20  # per size and round (more for small sizes: `calls_for`)
TARGET_ROUND_S = 0.05  # per size and round, the calls of a small size fill about this long
ROUNDS = 5  # each size's median over rounds of calls
WARMUP_CALLS = 20


@dataclass(frozen=True, slots=True)
class AllReduceTiming:
    """Seconds per all-reduce call of `n_bytes` float32 bytes on each of `degree` ranks."""

    degree: int
    n_bytes: tuple[int, ...]
    seconds: tuple[float, ...]

    def link(self) -> LinkSpec:
        """The ring formula's link fitted to these times (module docstring)."""
        n = np.asarray(self.n_bytes, float)
        t = np.asarray(self.seconds, float)
        design = np.stack([np.ones_like(n), n], axis=1)
        (c0, c1), *_ = np.linalg.lstsq(design, t, rcond=None)
        steps = 2 * (self.degree - 1)
        if c1 <= 0:  # no bandwidth term measured: price every byte at the largest size's rate
            c1 = t[-1] / n[-1]
        c0 = max(float(c0), 0.0)
        return LinkSpec(steps / (self.degree * float(c1)), c0 / steps)

    def to_json(self) -> dict:
        link = self.link()
        return {
            "degree": self.degree,
            "n_bytes": list(self.n_bytes),
            "seconds": list(self.seconds),
            "fitted_latency_us": link.latency_s * 1e6,
            "fitted_bandwidth_gbps": link.bandwidth_bytes_per_s * 8 / 1e9,
        }


def calls_for(n_bytes: int) -> int:
    """Calls per round: small sizes many (their time is a few microseconds), large ones `MIN_CALLS`."""
    return max(MIN_CALLS, min(2000, int(TARGET_ROUND_S / (5e-6 + n_bytes / 2e9))))


def measure_shm_all_reduce(degree: int, hidden_size: int, token_counts=TOKEN_COUNTS) -> AllReduceTiming:  # noqa: ANN001
    """Time the shared-memory all-reduce of `degree` ranks (this process and `degree - 1` started
    here, one torch thread each) on float32 tensors of `tokens x hidden_size` for each token count."""
    import torch

    from tessel.parallel.shm import ShmAllReduce, create_segment

    if degree < 2:
        raise ValueError(f"an all-reduce needs two ranks or more, got degree {degree}")
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="tessel-allreduce-") as folder:
        segment = Path(folder) / "segment"
        create_segment(segment, degree)
        pipes = [context.Pipe() for _ in range(degree - 1)]
        procs = [
            context.Process(
                target=_rank,
                args=(segment, rank, degree, hidden_size, tuple(token_counts), child),
                daemon=True,
            )
            for rank, (_parent, child) in enumerate(pipes, start=1)
        ]
        for proc in procs:
            proc.start()
        pids = [os.getpid()] + [proc.pid for proc in procs]
        for parent, _child in pipes:
            parent.send(pids)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            shm = ShmAllReduce(segment, 0, degree, pids)
            seconds = _calls(shm, hidden_size, token_counts)
        finally:
            torch.set_num_threads(threads)
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    n_bytes = tuple(tokens * hidden_size * 4 for tokens in token_counts)
    return AllReduceTiming(degree, n_bytes, tuple(seconds))


def _rank(segment: Path, rank: int, degree: int, hidden_size: int, token_counts: tuple, pipe) -> None:  # noqa: ANN001, PLR0913
    import torch

    from tessel.parallel.shm import ShmAllReduce

    torch.set_num_threads(1)
    pids = pipe.recv()
    _calls(ShmAllReduce(segment, rank, degree, pids), hidden_size, token_counts)


def _calls(shm, hidden_size: int, token_counts) -> list[float]:  # noqa: ANN001
    """Every rank runs the same calls in the same order; -> this rank's median seconds per call."""
    import torch

    result = []
    for tokens in token_counts:
        tensor = torch.zeros(tokens, hidden_size)  # sums of zeros: no value grows call after call
        calls = calls_for(tensor.numel() * 4)
        for _ in range(WARMUP_CALLS):
            shm.all_reduce(tensor)
        rounds = []
        for _ in range(ROUNDS):
            started = time.perf_counter()
            for _ in range(calls):
                shm.all_reduce(tensor)
            rounds.append((time.perf_counter() - started) / calls)
        result.append(statistics.median(rounds))
    return result
