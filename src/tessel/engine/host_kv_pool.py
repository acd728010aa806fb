"""A pool of KV blocks in host memory, where a preempted sequence's blocks wait to be copied back.

The pool is one tensor allocated when the engine starts, `[num_blocks, 2, layers, block_size,
kv_heads, head_dim]` (block-major, so one block is one contiguous run of bytes), in pinned memory
when the device cache is on CUDA (so the copies are DMA transfers, not staged through pageable
memory), with a free list of its own. `swap_out` copies device blocks into host blocks and
`swap_in` copies them back; both block until the copy is done and return the bytes moved and the
seconds it took.

Emulation (`tessel.engine.emulation.hold_link`): with `emulated_gbps` set (Gbit/s, as every
bandwidth in tessel), a copy that finished faster than `bytes / emulated_gbps` sleeps for the
difference, so a CPU-only machine behaves like a device behind a link of that bandwidth. The time
is then the emulated link's, never a measurement of a GPU's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tessel.engine.emulation import hold_link


@dataclass(slots=True)
class CopyResult:
    num_bytes: int
    seconds: float  # the whole copy, the emulation's wait included
    waited_s: float = 0.0  # of which slept to emulate a slower link


class HostKvPool:
    def __init__(self, num_blocks: int, kv_cache: torch.Tensor, emulated_gbps: float | None = None) -> None:
        """`kv_cache` is the device cache `[2, layers, blocks, block_size, kv_heads, head_dim]`; the pool
        holds `num_blocks` of its blocks."""
        if num_blocks < 1:
            raise ValueError(f"a host KV pool needs at least one block, got {num_blocks}")
        two, layers, _, block_size, heads, head_dim = kv_cache.shape
        self.kv_cache = kv_cache
        self.emulated_gbps = emulated_gbps
        pin = kv_cache.is_cuda
        # empty, not zeros: a host block is read only after a swap_out has written it
        self.cache = torch.empty(
            num_blocks, two, layers, block_size, heads, head_dim, dtype=kv_cache.dtype, pin_memory=pin
        )
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0 first
        self._is_free = [True] * num_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.cache.shape[0]

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def bytes_per_block(self) -> int:
        return self.cache[0].numel() * self.cache.element_size()

    def allocate(self, count: int) -> list[int] | None:
        """`count` host blocks, or None (and nothing taken) when fewer are free."""
        if count > len(self.free_blocks):
            return None
        taken = [self.free_blocks.pop() for _ in range(count)]
        for block in taken:
            self._is_free[block] = False
        return taken

    def free(self, host_blocks: list[int]) -> None:
        for block in host_blocks:
            assert not self._is_free[block], f"host block {block} freed twice"
            self._is_free[block] = True
        self.free_blocks.extend(reversed(host_blocks))

    def swap_out(self, device_blocks: list[int], host_blocks: list[int]) -> CopyResult:
        """Copy device blocks into host blocks (pairwise, in order)."""
        assert len(device_blocks) == len(host_blocks)
        start = time.perf_counter()
        index = torch.tensor(device_blocks, dtype=torch.int64, device=self.kv_cache.device)
        gathered = self.kv_cache.index_select(2, index).permute(2, 0, 1, 3, 4, 5)  # block-major
        if self.kv_cache.is_cuda:
            staged = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            staged.copy_(gathered, non_blocking=True)
            torch.cuda.current_stream(self.kv_cache.device).synchronize()
            gathered = staged
        self.cache.index_copy_(0, torch.tensor(host_blocks, dtype=torch.int64), gathered)
        return self._finish(len(device_blocks), start)

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> CopyResult:
        """Copy host blocks back into device blocks (pairwise, in order)."""
        assert len(device_blocks) == len(host_blocks)
        start = time.perf_counter()
        rows = self.cache.index_select(0, torch.tensor(host_blocks, dtype=torch.int64))
        if self.kv_cache.is_cuda:
            rows = rows.pin_memory().to(self.kv_cache.device, non_blocking=True)
        index = torch.tensor(device_blocks, dtype=torch.int64, device=self.kv_cache.device)
        self.kv_cache.index_copy_(2, index, rows.permute(1, 2, 0, 3, 4, 5))
        if self.kv_cache.is_cuda:
            torch.cuda.current_stream(self.kv_cache.device).synchronize()
        return self._finish(len(device_blocks), start)

    def repeat(self, direction: str, source: list[int], target: list[int]) -> CopyResult:
        """A copy that stage 0 of a pipeline made, on this stage's layers (`Preemptor.copies`)."""
        return self.swap_out(source, target) if direction == "out" else self.swap_in(source, target)

    def _finish(self, num_blocks: int, start: float) -> CopyResult:
        num_bytes = num_blocks * self.bytes_per_block
        elapsed_s = time.perf_counter() - start
        waited_s = hold_link(num_bytes, elapsed_s, self.emulated_gbps)
        return CopyResult(num_bytes, elapsed_s + waited_s, waited_s)
