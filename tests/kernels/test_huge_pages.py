"""`tessel.kernels.huge_pages`: buffers and moved tensors on transparent huge pages.

Oracle: the values, shapes and strides before the move (a move changes only where the bytes live),
the 2 MB boundary the mapping starts on, and the kernel's own record of the mapping
(/proc/self/smaps: its `VmFlags` carry `hg`, advised for huge pages; whether a fault then got one
depends on the kernel's free memory, so it is not asserted).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tessel.errors import TesselError
from tessel.kernels import huge_pages

SMAPS = Path("/proc/self/smaps")
needs_huge_pages = pytest.mark.skipif(
    not huge_pages.enabled(), reason="this kernel gives no transparent huge pages"
)


def _advised(address: int) -> bool:
    """Whether the mapping holding `address` is advised for huge pages (VmFlags `hg`)."""
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


@needs_huge_pages
def test_rehome_keeps_values_shapes_and_strides_and_starts_on_a_huge_page() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randint(-127, 128, (300, 7, 16, 64), generator=g, dtype=torch.int8),  # 2.1 MB
        torch.randint(-(2**31), 2**31 - 1, (33,), generator=g, dtype=torch.int32),  # a tail to align after
        torch.randint(-127, 128, (5, 3, 8, 32), generator=g, dtype=torch.int8),
        torch.randn(17, 3, generator=g),
    ]
    before = [t.clone() for t in tensors]
    views = [t.view(-1) for t in tensors]  # another tensor on the same storage sees the move too
    old_pointers = [t.data_ptr() for t in tensors]
    assert huge_pages.rehome(tensors)
    gc.collect()
    starts = [t.data_ptr() for t in tensors]
    assert starts[0] % huge_pages.HUGE_PAGE_BYTES == 0
    assert all(s % huge_pages.ALIGN_BYTES == 0 for s in starts)
    assert starts == sorted(starts) and len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert not set(starts) & set(old_pointers)
    for t, old in zip(tensors, before, strict=True):
        assert t.shape == old.shape and t.stride() == old.stride() and t.dtype == old.dtype
        assert torch.equal(t, old)
    for view, old in zip(views, before, strict=True):
        assert torch.equal(view, old.view(-1))
    # the whole 2 MB stretches advised; the part-filled last one (the tensors past 2 MB) left on 4 KB pages
    assert _advised(tensors[0].data_ptr()) and not _advised(tensors[-1].data_ptr())


@needs_huge_pages
def test_a_large_buffer_gets_its_own_mapping_a_small_one_torchs() -> None:
    big = huge_pages.empty(5 << 20)
    assert big.dtype == torch.int8 and big.numel() == 5 << 20
    assert big.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0 and _advised(big.data_ptr())
    big.fill_(3)
    assert int(big[-1]) == 3 and int(big.sum(dtype=torch.int64)) == 3 * (5 << 20)
    assert _advised(big.data_ptr() + (4 << 20) - 1) and not _advised(big.data_ptr() + (4 << 20))
    small = huge_pages.empty(1000)
    assert small.numel() == 1000 and small.untyped_storage().nbytes() == 1000  # torch's, not a mapping


def test_off_moves_nothing_and_bad_values_are_refused(monkeypatch) -> None:
    monkeypatch.setenv(huge_pages.ENV_OVERRIDE, "off")
    t = torch.zeros(3 << 20, dtype=torch.int8)
    pointer = t.data_ptr()
    assert not huge_pages.rehome([t]) and t.data_ptr() == pointer
    assert huge_pages.empty(3 << 20).untyped_storage().nbytes() == 3 << 20
    monkeypatch.setenv(huge_pages.ENV_OVERRIDE, "yes")
    with pytest.raises(TesselError, match="TESSEL_HUGE_PAGES='yes'"):
        huge_pages.enabled()
    monkeypatch.setenv(huge_pages.ENV_OVERRIDE, "on")
    with pytest.raises(TesselError, match="contiguous CPU tensors"):
        huge_pages.rehome([torch.zeros(4, 4).t()])
    assert not huge_pages.rehome([torch.zeros(100, dtype=torch.int8)])  # under 2 MB: left where it is
