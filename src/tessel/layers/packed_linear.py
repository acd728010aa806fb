"""Linear layers with the weight reordered once for oneDNN: the engine's float32 CPU GEMMs.

A float32 `F.linear` on CPU runs the default sgemm on the row-major weight. oneDNN's JIT GEMM on
a weight reordered into its blocked layout is faster on the engine benchmark model's shapes
(`benchmarks/packed_linear.py`; docs/results.md), with float32 accumulation (errors against
float64 of the order of `F.linear`'s). `pack_linears(model)` swaps every
float32 `nn.Linear` and the `LMHead` for a `PackedLinear` holding the reordered weight; it does
nothing where PyTorch has no oneDNN. Inference only: the packed weight has no gradient.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tessel.layers.embedding import LMHead

PACKED_DTYPES = (torch.float32,)
BATCH_HINT = 32  # rows oneDNN tunes the weight layout for (a decode step's batch); any count works
# oneDNN builds and caches one primitive per input shape, each holding memory, so a run with many
# distinct row counts grows. Calls therefore see only a few row counts: inputs are cut into tiles
# of TILE_ROWS and a short tile is zero-padded to a bucket, so a weight gets at most 13 primitives
# (the engine benchmark's peak RSS stays below HF's: benchmarks/results/engine_throughput.json).
TILE_ROWS = 256
BUCKET_STEP = 32  # above this many rows, buckets are multiples of it; below, powers of two


@functools.cache
def packing_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8), 1)
    except (AttributeError, RuntimeError):
        return False
    return True


def bucket_rows(rows: int) -> int:
    """The row count a GEMM call of `rows` rows (1 <= rows <= TILE_ROWS) is padded to."""
    if rows <= BUCKET_STEP:
        return 1 << (rows - 1).bit_length()
    return -(-rows // BUCKET_STEP) * BUCKET_STEP


class PackedLinear(nn.Module):
    """y = x @ weight.T + bias, x [..., in_features] float32 on CPU, weight reordered for oneDNN."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # plain attributes, not parameters: the opaque oneDNN tensor has no storage to save or move
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= TILE_ROWS:
            out = self._gemm(rows)
        else:
            out = torch.cat([self._gemm(tile) for tile in rows.split(TILE_ROWS)])
        return out.view(*x.shape[:-1], self.out_features)

    def _gemm(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        padded = bucket_rows(n)
        if padded != n:
            rows = F.pad(rows, (0, 0, 0, padded - n))
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out[:n]

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES


def pack_linears(model: nn.Module) -> int:
    """Replace, in place, each float32 CPU `nn.Linear` and `LMHead` of `model` by a `PackedLinear`;
    -> how many. A tied LM head gets its own packed copy; the embedding keeps the plain weight."""
    if not packing_available():
        return 0
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear | LMHead) and _packable(child.weight)
    ]
    for parent, name in targets:  # one at a time: each plain weight is freed before the next is packed
        layer = getattr(parent, name)
        bias = layer.bias if isinstance(layer, nn.Linear) else None
        setattr(parent, name, PackedLinear(layer.weight, bias))
        del layer, bias
    return len(targets)
