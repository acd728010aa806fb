"""Weights a one-row decode step streams, on transparent huge pages (Linux).

A one-row step reads every int8 weight once, far past the caches; on 4 KB pages that stream crosses
a page, so a TLB miss, every 4 KB. On 2 MB pages the same kernels read faster
(`benchmarks/int8_gemv.py --only engine` times the native step both ways). Linux hands out huge
pages for memory a process marks with madvise(MADV_HUGEPAGE) when transparent huge pages are
`always` or `madvise` (the usual default); torch's own allocations are not marked, and a huge page
covers only a 2 MB-aligned 2 MB stretch, which the small matrices of a small model never fill.

    empty(n_bytes)      a new int8 buffer: its own marked mapping from 2 MB up (the LM head, any
                        large model's matrices), else torch's memory
    rehome(tensors)     tensors moved, in order, into one marked mapping (a stage's packed layers:
                        many small matrices, one stretch); their storage changes under them
                        (`Tensor.set_`), their values, shapes and strides do not

Only whole 2 MB stretches are advised, so a mapping holds at most one part-filled stretch on 4 KB
pages and no huge page of padding. A mapping lives as long as any tensor in it. Neither function
does anything where the kernel gives no huge pages (not Linux, or `never`) or with
`TESSEL_HUGE_PAGES=off` (comparisons).
"""

from __future__ import annotations

import functools
import mmap
import os
from pathlib import Path

import torch

from tessel.errors import TesselError

ENV_OVERRIDE = "TESSEL_HUGE_PAGES"
HUGE_PAGE_BYTES = 2 << 20
ALIGN_BYTES = 64  # each tensor's start: a cache line (the kernels' loads)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def enabled() -> bool:
    """$TESSEL_HUGE_PAGES (`on`, the default, or `off`) and whether this kernel gives huge pages."""
    value = os.environ.get(ENV_OVERRIDE, "on").strip().lower() or "on"
    if value not in ("on", "off"):
        raise TesselError(f"{ENV_OVERRIDE}={value!r}: choose on or off")
    return value == "on" and _kernel_gives_them()


@functools.cache
def _kernel_gives_them() -> bool:
    """Transparent huge pages `always` or `madvise` (the bracketed word of the setting)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def _mapping(n_bytes: int) -> torch.Tensor:
    """uint8 [n_bytes] starting on a 2 MB boundary of an anonymous mapping whose whole 2 MB stretches
    are marked for huge pages (a part-filled last stretch is not: a huge page there would hold up to
    2 MB of nothing; it stays on 4 KB pages)."""
    region = mmap.mmap(-1, n_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive while any view is
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    # before any page is touched: the faults then take huge pages
    region.madvise(mmap.MADV_HUGEPAGE, start, n_bytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    return whole[start : start + n_bytes]


def empty(n_bytes: int) -> torch.Tensor:
    """An uninitialised int8 buffer [n_bytes]: on huge pages from 2 MB up where they are given."""
    if n_bytes < HUGE_PAGE_BYTES or not enabled():
        return torch.empty(n_bytes, dtype=torch.int8)
    return _mapping(n_bytes).view(torch.int8)


def rehome(tensors: list[torch.Tensor]) -> bool:
    """Move contiguous CPU `tensors` into one mapping on huge pages, each at a 64-byte boundary, in
    order; False (nothing moved) where huge pages are not given, or for fewer than 2 MB in all."""
    offsets, total = [], 0
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise TesselError(f"rehome takes contiguous CPU tensors; got {t.device} {tuple(t.stride())}")
        total = -(-total // ALIGN_BYTES) * ALIGN_BYTES
        offsets.append(total)
        total += t.numel() * t.element_size()
    if total < HUGE_PAGE_BYTES or not enabled():
        return False
    arena = _mapping(total)
    for t, offset in zip(tensors, offsets, strict=True):
        n_bytes = t.numel() * t.element_size()
        arena[offset : offset + n_bytes].copy_(t.reshape(-1).view(torch.uint8))
        storage_offset = (arena.storage_offset() + offset) // t.element_size()
        with torch.no_grad():
            t.set_(arena.untyped_storage(), storage_offset, t.shape, t.stride())
    return True
