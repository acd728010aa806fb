"""A linear module's CPU forward for several rows, split around its library GEMM call.

The compiled multi-row decode step (`tessel.engine.batch_decode_graph`) traces the small ops
between the linears into graphs and calls each linear's GEMM eagerly between them: fbgemm's and
oneDNN's kernels have no traced form, and at 32 rows they are the step's arithmetic. A split
linear says which of its ops can join the graphs on either side of that call:

    pre(x)             traced   -> (what the call reads, what the epilogue carries)
    call(inputs)       eager    -> the GEMM's output
    post(acc, carried) traced   -> y

    fbgemm8   W8A8 on fbgemm with 8-bit activation codes (AVX-512 VNNI's default):
              pre  = codes, scale = quantize_per_token's formula (codes left in float32)
              call = fbgemm's int8 GEMM on the codes (unit weight scales: the integer sums)
              post = (sums * scale[:, None]) * w_scale (+ bias, by addcmul): `int8_epilogue`'s ops
    fp16codes W8A8 on `fp16codes` with dynamic activations (AVX2's default): the same pre and post,
              call = fbgemm's fp16-weight GEMM on the codes (the same integer sums below 2**24)
    opaque    any other module: pre = x, call = module(x), post = y (the module's own forward)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tessel.kernels.int8_cpu import UINT8_ZERO_POINT, _given_qparams_linear, _quietly, fp16_codes_matmul
from tessel.kernels.w8a16_cpu import quantize_rows_formula
from tessel.layers.quantized_linear import W8A8Linear


@dataclass(frozen=True, slots=True)
class SplitLinear:
    """`post(call(pre(x)))` is the module's forward on rows x [M, K]; `weights` are post's tensors."""

    kind: str  # "fbgemm8" | "fp16codes" | "opaque"
    module: nn.Module
    weights: tuple[torch.Tensor, ...] = ()

    @property
    def traced_pre(self) -> bool:
        """Whether `pre` computes anything (an opaque linear's call reads x itself)."""
        return self.kind != "opaque"

    @property
    def num_carried(self) -> int:
        """How many tensors `pre` hands to `post` besides the call's one input."""
        return 0 if self.kind == "opaque" else 1

    signature: tuple = ()  # what a graph holding `pre` or `post` depends on (set at construction)

    def __post_init__(self) -> None:
        # worked out once: the batch step looks it up for each of its graph calls
        signature = (self.kind, *((t.shape, t.dtype) for t in self.weights))
        object.__setattr__(self, "signature", signature)

    def pre(self, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the call's inputs, the tensors `post` takes besides the GEMM's output); traceable."""
        if self.kind != "opaque":
            codes, scale = quantize_rows_formula(x)
            return [codes], [scale]
        return [x], []

    def call(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """The library GEMM, eager, on the rows `pre` gave (contiguous)."""
        if self.kind == "fbgemm8":
            packed = self.module._packed.packed
            return _quietly(_given_qparams_linear(), inputs[0], 1.0, UINT8_ZERO_POINT, packed)
        if self.kind == "fp16codes":
            return fp16_codes_matmul(inputs[0], self.module._packed)
        return self.module(inputs[0])

    def post(
        self, acc: torch.Tensor, carried: list[torch.Tensor], weights: list[torch.Tensor]
    ) -> torch.Tensor:
        """y from the GEMM's output; `weights` stand for `self.weights` (placeholders when traced)."""
        if self.kind != "opaque":
            out = acc * carried[0][:, None]
            return out * weights[0] if len(weights) == 1 else torch.addcmul(weights[1], out, weights[0])
        return acc


def split_linear(module: nn.Module) -> SplitLinear:
    """`module`'s split form: fbgemm8 or fp16codes where it applies, else opaque."""
    kind = _codes_kind(module) if isinstance(module, W8A8Linear) else None
    if kind is None:
        return SplitLinear("opaque", module)
    weights = (module.weight_scale,) + (() if module.bias is None else (module.bias,))
    return SplitLinear(kind, module, weights)


def _codes_kind(module: W8A8Linear) -> str | None:
    """The split kind of a W8A8 module whose GEMM reads per-token codes, or None."""
    if module._packed is None or module.input_scale is not None:
        return None
    if module.path == "fbgemm" and module._fbgemm_act_bits == 8 and _given_qparams_linear() is not None:
        return "fbgemm8"
    return "fp16codes" if module.path == "fp16codes" else None
