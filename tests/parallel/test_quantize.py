"""A row-parallel W8A8 linear over two ranks rounds as one process: its int8 codes side by side are
the whole layer's, its scales the whole rows', and the ranks' outputs sum to the whole layer's
output (up to float rounding of that sum); a per-slice rounding would not (the oracle's check)."""

from __future__ import annotations

import os
import threading

import torch
from torch import nn

from tessel.models.quantized.load_quantize import quantized_linear
from tessel.parallel.group import TPGroup
from tessel.parallel.quantize import row_parallel_int8
from tessel.parallel.shm import ShmAllReduce, create_segment


def _on_two_ranks(tmp_path, work):  # noqa: ANN001, ANN202
    """work(group) on two ranks (threads, over a shared-memory segment) -> their results."""
    path = tmp_path / "segment"
    create_segment(path, 2)
    pids = [os.getpid()] * 2
    groups = [TPGroup(r, 2, torch.device("cpu"), shm=ShmAllReduce(path, r, 2, pids)) for r in range(2)]
    results: list = [None, None]

    def run(rank: int) -> None:
        results[rank] = work(groups[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_row_parallel_int8_rounds_as_the_whole_row(tmp_path) -> None:
    torch.manual_seed(0)
    full = nn.Linear(48, 20, bias=True)
    with torch.no_grad():
        full.weight[:, 30:] *= 4  # rows whose maximum sits in the second rank's slice
    x = torch.randn(7, 48)
    x[:, 40] *= 10  # tokens whose maximum too
    whole = quantized_linear(full, "int8", torch.float32)
    cols = [slice(0, 24), slice(24, 48)]

    def work(group: TPGroup):  # noqa: ANN202
        part = nn.Linear(24, 20, bias=group.rank == 0)
        with torch.no_grad():
            part.weight.copy_(full.weight[:, cols[group.rank]])
            if group.rank == 0:
                part.bias.copy_(full.bias)
        layer = row_parallel_int8(part, group)
        return layer, layer(x[:, cols[group.rank]].clone())

    (left, out0), (right, out1) = _on_two_ranks(tmp_path, work)
    codes = torch.cat([left.inner.weight[:, :-1], right.inner.weight[:, :-1]], dim=1)
    assert torch.equal(codes, whole.weight)
    assert torch.equal(left.inner.weight_scale, whole.weight_scale)
    assert torch.equal(right.inner.weight_scale, whole.weight_scale)
    assert not left.inner.weight[:, -1].any() and not right.inner.weight[:, -1].any()
    torch.testing.assert_close(out0 + out1, whole(x), rtol=1e-5, atol=1e-5)
    per_slice = torch.cat(
        [quantized_linear(_linear(full.weight[:, c]), "int8", torch.float32).weight for c in cols], dim=1
    )
    assert not torch.equal(per_slice, whole.weight)  # what a rank would get rounding its slice alone


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer
