"""What happens to a preempted sequence's KV blocks: copied to the host pool and back, or dropped and
recomputed, chosen per sequence by cost.

    swap_s      = bytes / to_host_bandwidth + bytes / to_device_bandwidth
    recompute_s = (tokens with k/v) * prefill seconds per token

`bytes` are the sequence's computed blocks; the bandwidths are the host link's, measured once when
the engine starts with a real copy (`measure_host_link`: pinned host <-> device on CUDA, a host
memcpy on the CPU), or the emulated bandwidth when one is set and slower; the prefill seconds per
token are the engine's own, measured on its steps that prefill (`PrefillClock`). Modes:

    recompute   always drop and recompute (no host pool)
    swap        always copy to the host pool
    auto        the cheaper of the two; recompute until a prefill step has been timed

A swap that finds the host pool full recomputes instead (`PreemptionStats.swap_fallbacks`): a
request is never lost to a full pool.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch

from tessel.engine.block_manager import FREED, BlockManager
from tessel.engine.host_kv_pool import HostKvPool
from tessel.engine.sequence import Sequence
from tessel.errors import TesselError
from tessel.units import GBPS

PREEMPTION_MODES = ("auto", "swap", "recompute")
KvCopy = tuple[str, list[int], list[int]]  # ("out", device blocks, host blocks) or ("in", host, device)
LINK_PROBE_BYTES = 16 * 2**20  # long enough for a stable copy time, short enough for every start
LINK_PROBE_REPEATS = 3  # the fastest of a few copies: the first may pay page faults
DEFAULT_HOST_KV_CACHE_BYTES = 4 * 2**30  # cap on the default host pool (vLLM's default swap space)
PREFILL_WINDOW = 16  # prefill steps the clock remembers: recent steps describe the current load


def check_preemption_mode(mode: str) -> str:
    if mode not in PREEMPTION_MODES:
        raise TesselError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; got {mode!r}")
    return mode


@dataclass(slots=True)
class HostLink:
    """Gbit/s each way between the device's KV cache and host memory: what the decision uses
    (`to_host_gbps`, `to_device_gbps`: the measured ones, or the emulated one where slower)."""

    to_host_gbps: float
    to_device_gbps: float
    measured_to_host_gbps: float
    measured_to_device_gbps: float
    emulated_gbps: float | None = None

    def swap_seconds(self, num_bytes: int) -> float:
        """Out and back in."""
        return num_bytes / (self.to_host_gbps * GBPS) + num_bytes / (self.to_device_gbps * GBPS)


def _timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    best = math.inf
    for _ in range(LINK_PROBE_REPEATS):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=dst.is_cuda or src.is_cuda)
        if dst.is_cuda or src.is_cuda:
            torch.cuda.synchronize(dst.device if dst.is_cuda else src.device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure_host_link(
    device: torch.device, emulated_gbps: float | None = None, num_bytes: int = LINK_PROBE_BYTES
) -> HostLink:
    """Copy `num_bytes` host -> device and back (pinned host memory on CUDA; on the CPU, host memory to
    host memory, what a swap there does) and take the fastest of a few copies each way."""
    count = num_bytes // 4
    if device.type == "cuda":
        host = torch.ones(count, dtype=torch.float32, pin_memory=True)
        dev = torch.empty(count, dtype=torch.float32, device=device)
        to_device_s = _timed_copy(dev, host)
        to_host_s = _timed_copy(host, dev)
    else:
        a, b = torch.ones(count, dtype=torch.float32), torch.empty(count, dtype=torch.float32)
        to_device_s = _timed_copy(b, a)
        to_host_s = _timed_copy(a, b)
    out_gbps, in_gbps = count * 4 / to_host_s / GBPS, count * 4 / to_device_s / GBPS
    if emulated_gbps is None:
        return HostLink(out_gbps, in_gbps, out_gbps, in_gbps)
    out, into = min(out_gbps, emulated_gbps), min(in_gbps, emulated_gbps)
    return HostLink(out, into, out_gbps, in_gbps, emulated_gbps)


class PrefillClock:
    """Prefill seconds per token, from the engine's own steps that prefill: the median of the last
    `PREFILL_WINDOW` steps' seconds / tokens (a median shrugs off a step that compiled something)."""

    def __init__(self) -> None:
        self._rates: deque[float] = deque(maxlen=PREFILL_WINDOW)

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self._rates.append(seconds / num_tokens)

    def seconds_for(self, num_tokens: int) -> float | None:
        """Seconds to prefill `num_tokens`, or None before any prefill step was timed."""
        if not self._rates:
            return None
        return num_tokens * statistics.median(self._rates)


@dataclass(slots=True)
class PreemptionStats:
    """Counts since the engine started; `/metrics` reports them."""

    swaps: int = 0
    recomputes: int = 0
    swap_fallbacks: int = 0  # swaps that found the host pool full and recomputed instead
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    swap_out_s: float = 0.0
    swap_in_s: float = 0.0
    emulated_wait_s: float = 0.0  # of the copies' seconds, slept to emulate `emulate_host_gbps`


class Preemptor:
    """Frees a preempted sequence's device blocks by the chosen mode, and restores swapped ones."""

    def __init__(
        self,
        mode: str,
        block_manager: BlockManager,
        pool: HostKvPool | None = None,
        link: HostLink | None = None,
        clock: PrefillClock | None = None,
        stats: PreemptionStats | None = None,
    ) -> None:
        check_preemption_mode(mode)
        if mode != "recompute" and (pool is None or link is None):
            raise ValueError(f"preemption mode {mode} needs a host pool and a host link")
        self.mode = mode
        self.block_manager = block_manager
        self.pool = pool
        self.link = link
        self.clock = clock or PrefillClock()
        self.stats = stats if stats is not None else PreemptionStats()  # an engine's, across executors
        # a pipeline's stage 0: every copy made here, for the other stages to repeat on their own
        # layers' KV (`KvCopy`: "out" device -> host blocks, "in" host -> device blocks), in order
        self.copies: list[KvCopy] | None = None

    def take_copies(self) -> list[KvCopy]:
        """The copies recorded since the last call (none unless recording)."""
        if not self.copies:
            return []
        taken, self.copies = self.copies, []
        return taken

    def swap_bytes(self, seq: Sequence) -> int:
        assert self.pool is not None
        return seq.num_blocks_for(seq.num_computed_tokens) * self.pool.bytes_per_block

    def choose(self, seq: Sequence) -> str:
        """ "swap" or "recompute" for `seq` (its computed tokens are what either would bring back)."""
        if self.mode == "recompute" or seq.num_computed_tokens == 0:
            return "recompute"
        if self.mode == "swap":
            return "swap"
        recompute_s = self.clock.seconds_for(seq.num_computed_tokens)
        if recompute_s is None:
            return "recompute"
        assert self.link is not None
        return "swap" if self.link.swap_seconds(self.swap_bytes(seq)) < recompute_s else "recompute"

    def preempt(self, seq: Sequence) -> str:
        """Free `seq`'s device blocks, its computed ones copied to the host first when swapping;
        -> the mode it got ("swap" or "recompute": `num_computed_tokens` is then 0)."""
        # a windowed sequence whose early blocks were freed (`free_behind_window`) is recomputed
        if self.choose(seq) == "swap" and FREED not in seq.block_table and self._swap_out(seq):
            self.stats.swaps += 1
            self.block_manager.free(seq)
            return "swap"
        self.stats.recomputes += 1
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        return "recompute"

    def _swap_out(self, seq: Sequence) -> bool:
        assert self.pool is not None
        count = seq.num_blocks_for(seq.num_computed_tokens)
        host = self.pool.allocate(count)
        if host is None:
            self.stats.swap_fallbacks += 1
            return False
        copied = self.pool.swap_out(seq.block_table[:count], host)
        if self.copies is not None:
            self.copies.append(("out", seq.block_table[:count], host))
        self.stats.bytes_to_host += copied.num_bytes
        self.stats.swap_out_s += copied.seconds
        self.stats.emulated_wait_s += copied.waited_s
        seq.host_blocks = host
        return True

    def can_swap_in(self, seq: Sequence) -> bool:
        return seq.num_blocks_for(len(seq)) <= self.block_manager.num_free_blocks

    def swap_in(self, seq: Sequence) -> None:
        """Give a swapped `seq` device blocks for all its tokens and copy its computed ones back."""
        assert self.pool is not None and seq.host_blocks
        computed, cached = seq.num_computed_tokens, seq.metrics.num_cached_tokens
        self.block_manager.allocate(seq, 0)
        copied = self.pool.swap_in(seq.host_blocks, seq.block_table[: len(seq.host_blocks)])
        if self.copies is not None:
            self.copies.append(("in", seq.host_blocks, seq.block_table[: len(seq.host_blocks)]))
        self.stats.bytes_to_device += copied.num_bytes
        self.stats.swap_in_s += copied.seconds
        self.stats.emulated_wait_s += copied.waited_s
        self.pool.free(seq.host_blocks)
        seq.host_blocks = []
        seq.num_computed_tokens = computed
        seq.metrics = seq.metrics.but(num_cached_tokens=cached)
        self.block_manager.register_computed_blocks(seq)

    def release(self, seq: Sequence) -> None:
        """Give back the host blocks of a swapped `seq` that finishes (an abort) before it runs again."""
        if seq.host_blocks:
            assert self.pool is not None
            self.pool.free(seq.host_blocks)
            seq.host_blocks = []


def host_pool_blocks(
    host_kv_cache_gib: float | None,
    bytes_per_block: int,
    device_blocks: int,
    host_available: int | None,
    layer_share: float = 1.0,
) -> int:
    """Blocks of the host pool: `host_kv_cache_gib` of them, or by default as many as the device pool
    holds, at most DEFAULT_HOST_KV_CACHE_BYTES and half the host's available memory (where known);
    refused when an explicit size holds no block. A pipeline stage holding `layer_share` of the
    layers gets that share of the bytes (every stage then holds the same number of blocks)."""
    if host_kv_cache_gib is None:
        cap = DEFAULT_HOST_KV_CACHE_BYTES
        if host_available is not None:  # bytes
            cap = min(cap, host_available // 2)
        return max(1, min(device_blocks, int(cap * layer_share) // bytes_per_block))
    blocks = int(host_kv_cache_gib * layer_share * 2**30 // bytes_per_block)
    if blocks < 1:
        raise TesselError(
            f"host_kv_cache_gib={host_kv_cache_gib:g} holds no KV block ({bytes_per_block} bytes each); "
            "raise it, or use preemption_mode recompute"
        )
    return blocks
