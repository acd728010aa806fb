"""The dense float layer: `Linear`, on tessel's GEMM or on a weight packed once for oneDNN.

    gemm    y = x @ weight.T + bias by tessel's GEMM (`tessel.kernels.linear`: Triton on CUDA,
            PyTorch's on CPU), with gradients (a backward written with torch matmuls). Same
            parameters, state_dict and constructor as nn.Linear, so it loads nn.Linear checkpoints.
    packed  the engine's float32 CPU GEMM: oneDNN's JIT GEMM on the weight reordered once into its
            blocked layout, faster than the default sgemm on the row-major weight on the engine
            benchmark model's shapes (`benchmarks/packed_linear.py`; docs/results.md), float32 sums
            (errors against float64 of the order of `F.linear`'s). Inference only: the reordered
            weight has no gradient, no storage to save or move, and the layer no parameters.

`pack_linears(model)` swaps every float32 CPU `nn.Linear` and the `LMHead` of a model for a packed
`Linear` (the engine does, with `pack_cpu_linears`); it does nothing where PyTorch has no oneDNN.
The weight-only schemes without an int8 kernel of their own (W4A16, asymmetric or grouped W8A16)
run as a float `nn.Linear` holding the de-quantised weight (`dequantized_linear`), packed like any.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessel.kernels.w8a16_gemm import linear
from tessel.layers import buckets
from tessel.layers.embedding import LMHead
from tessel.layers.linear.forms import LinearForm, TracedForms, float_form
from tessel.layers.linear.int8_weights import rows_of

PACKED_DTYPES = (torch.float32,)
BATCH_HINT = 32  # rows oneDNN tunes the weight layout for (a decode step's batch); any count works
# oneDNN builds and caches one primitive per input shape, each holding memory, so a run with many
# distinct row counts grows. Calls therefore see only a few row counts: inputs are cut into tiles
# of TILE_ROWS and a short tile is zero-padded to a bucket, so a weight gets at most 13 primitives
# (the engine benchmark's peak RSS stays below HF's: benchmarks/results/engine_throughput.jsonl).
TILE_ROWS = 256


@functools.cache
def packing_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8), 1)
    except (AttributeError, RuntimeError):
        return False
    return True


def onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (float32 or bfloat16) reordered into oneDNN's blocked layout (opaque)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


# The row count a GEMM call of `rows` rows (1 <= rows <= TILE_ROWS) is padded to: the one ladder's
# rung (`tessel.layers.buckets`) at its packed-linear step.
packed_bucket_rows = functools.partial(buckets.bucket_rows, step=buckets.PACKED_ROWS_STEP)


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A weight [N, K] in oneDNN's layout and its bias: y = rows @ weight.T + bias, tiled and bucketed."""

    weight: torch.Tensor  # opaque oneDNN tensor
    bias: torch.Tensor | None

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] <= TILE_ROWS:
            return self._gemm(rows)
        return torch.cat([self._gemm(tile) for tile in rows.split(TILE_ROWS)])

    def _gemm(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        padded = packed_bucket_rows(n)
        if padded != n:
            rows = F.pad(rows, (0, 0, 0, padded - n))
        out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return out[:n]


class _LinearFunction(torch.autograd.Function):
    """Forward on tessel's GEMM; backward with torch matmuls (dx = dy @ W, dW = dy.T @ x, db = sum dy)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad_out.t() @ x if ctx.needs_input_grad[1] else None
        grad_b = grad_out.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class Linear(nn.Linear, TracedForms):
    """y = x @ weight.T + bias in float on tessel's GEMM (`gemm`), or on oneDNN's (`packed`, built by
    `packed_linear`: `weight` and `bias` are then None, held in oneDNN's layout instead)."""

    packed_weight: PackedWeight | None = None

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> Linear:
        """A tessel Linear sharing `layer`'s parameters."""
        new = cls(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        new.weight = layer.weight
        new.bias = layer.bias
        return new

    @property
    def path(self) -> str:
        return "gemm" if self.packed_weight is None else "packed"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            out = self.packed_weight(x.reshape(-1, self.in_features))
            return out.view(*x.shape[:-1], self.out_features)
        rows = rows_of(x, self.in_features)
        out = _LinearFunction.apply(rows, self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def one_row_form(self) -> LinearForm | None:
        return None if self.packed_weight is not None else float_form(self.weight, self.bias)

    def extra_repr(self) -> str:
        bias = self.bias is not None or (
            self.packed_weight is not None and self.packed_weight.bias is not None
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, path={self.path}"
        )


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """The packed `Linear` of a float32 CPU weight [N, K] and bias [N] (neither kept):
    y = x @ weight.T + bias on oneDNN."""
    out_features, in_features = weight.shape
    layer = Linear(in_features, out_features, bias=False, device="meta")
    layer.weight = None
    layer.packed_weight = PackedWeight(onednn_weight(weight), None if bias is None else bias.detach())
    return layer


def _packable(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return weight is not None and weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES


def pack_linears(model: nn.Module) -> int:
    """Replace, in place, each float32 CPU `nn.Linear` and `LMHead` of `model` by a packed `Linear`;
    -> how many. A tied LM head gets its own packed copy; the embedding keeps the plain weight."""
    if not packing_available():
        return 0
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear | LMHead) and _packable(child)
    ]
    for parent, name in targets:  # one at a time: each plain weight is freed before the next is packed
        layer = getattr(parent, name)
        bias = layer.bias if isinstance(layer, nn.Linear) else None
        setattr(parent, name, packed_linear(layer.weight, bias))
        del layer, bias
    return len(targets) + _pack_experts(model)


def _pack_experts(model: nn.Module) -> int:
    """Pack the routed experts of MoE layers too (`tessel.layers.moe.ExpertMLPs`, found by its
    `packs_with_linears` flag: that module imports this one); -> how many layers."""
    experts = [m for m in model.modules() if getattr(m, "packs_with_linears", False) and m.packed is None]
    experts = [m for m in experts if m.gate_up_proj is not None and _packable_tensor(m.gate_up_proj)]
    for module in experts:
        module.pack()
    return len(experts)


def _packable_tensor(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES


def dequantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    """A float nn.Linear holding the de-quantised weight (weight-only schemes without an int8 path)."""
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=dtype)
    layer.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return layer
