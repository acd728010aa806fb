"""A stage's device-resident KV under memory pressure, in the simulator.

A plan stage that evicts KV (`kv_evicted_gib` > 0 in the plan file) keeps only part of its KV on the
device: `KvPool.tokens` tokens, all running sequences together. When the KV of every running
sequence (prompt tokens scheduled + tokens generated) exceeds that, the excess is evicted; a batch
first brings back its share of it, the fraction of the running KV its own sequences hold, by the
stage's mode (`swap`: out to host and back over its host link; `recompute`: the stage's prefill of
that context), at `KvPool.restore_s(tokens)`. The simulator charges that time like offloading and
counts, per stage, the batches that restored, the tokens and the seconds (`KvRestoreStats`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KvPool:
    tokens: int  # KV tokens the stage keeps on its device, all running sequences together
    mode: str  # "swap" or "recompute"
    restore_s: Callable[[int], float]  # seconds to bring back n tokens of KV by `mode`

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise ValueError(f"a KV pool holds >= 0 tokens, got {self.tokens}")
        if self.mode not in ("swap", "recompute"):
            raise ValueError(f"KV pool mode must be swap or recompute, got {self.mode!r}")


@dataclass(frozen=True, slots=True)
class KvRestoreStats:
    """Evicted KV one stage brought back during a run."""

    mode: str
    batches: int  # batches that restored some KV before computing
    tokens: int
    seconds: float

    def to_json(self) -> dict:
        return {"mode": self.mode, "batches": self.batches, "tokens": self.tokens, "seconds": self.seconds}


class KvPoolCounter:
    """One stage's pool and what it restored so far."""

    __slots__ = ("batches", "pool", "seconds", "tokens")

    def __init__(self, pool: KvPool) -> None:
        self.pool = pool
        self.batches, self.tokens, self.seconds = 0, 0, 0.0

    def restore_s(self, running_tokens: Iterable[int], batch_tokens: int) -> float:
        """Seconds for a batch whose sequences hold `batch_tokens` of KV to bring back its share of
        what is evicted while the running sequences hold `running_tokens` (0: nothing evicted)."""
        in_use = sum(running_tokens)
        over = in_use - self.pool.tokens
        if over <= 0 or batch_tokens <= 0:
            return 0.0
        tokens = -(-over * min(batch_tokens, in_use) // in_use)  # ceil(over x its share), exact
        seconds = self.pool.restore_s(tokens)
        self.batches += 1
        self.tokens += tokens
        self.seconds += seconds
        return seconds

    def stats(self) -> KvRestoreStats:
        return KvRestoreStats(self.pool.mode, self.batches, self.tokens, self.seconds)
