"""A linear module's one-row CPU forward as a function inductor can trace, for the compiled decode step.

`linear_form(module)` -> `LinearForm(kind, tensors)`, or None where the module's one-row forward
calls a library kernel a traced graph cannot hold (fbgemm, oneDNN's packed weight, bfloat16's
`_weight_int8pack_mm`). `form.apply(x, form.inputs)` computes, for a float32 row x [1, K], the
module's formula with the same functions its own forward compiles (`tessel.kernels.w8a16_cpu`):

    w8a8      codes, s = quantize_per_token(x) (dynamic) or round(x / s_in) (static)
              y = (sum_k codes[k] * q_w[n, k]) * s * s_w[n] (+ bias)       float32 sums, exact < 2**24
    w8a16     y = (sum_k x[k] * q_w[n, k]) * s_w[n] (+ bias)
    float     y = x @ w.T (+ bias)

and returns (y, kept): `kept` are the row x and W8A8's codes, which the graph must store. Inductor
otherwise inlines a pointwise producer into the reduction that reads it, recomputing the codes
(or the SiLU before the down projection) for every output channel, several times slower
(`benchmarks/decode_graph.py`). Returned as graph outputs, they are stored once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tessel.kernels.quantize import QMAX
from tessel.kernels.w8a16_cpu import gemv_formula, gemv_scaled_formula, quantize_rows_formula
from tessel.layers.quantized_linear import W8A8Linear, W8A16CPULinear

Kept = list[torch.Tensor]


def _w8a8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, Kept]:
    codes, scale = quantize_rows_formula(x)
    return gemv_scaled_formula(codes, w, scale, w_scale), [codes]


def _w8a8_static(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, input_scale: torch.Tensor
) -> tuple[torch.Tensor, Kept]:
    codes = torch.round(x / input_scale).clamp(-QMAX, QMAX)
    return gemv_scaled_formula(codes, w, input_scale.expand(x.shape[0]), w_scale), [codes]


def _w8a16(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, Kept]:
    return gemv_formula(x, w, w_scale), []


def _float(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, Kept]:
    return x @ w.t(), []


_FORMULAS = {"w8a8": _w8a8, "w8a8_static": _w8a8_static, "w8a16": _w8a16, "float": _float}


@dataclass(frozen=True, slots=True)
class LinearForm:
    """y = FORMULA[kind](x, *tensors) (+ bias): the module's one-row numbers, traceable."""

    kind: str
    tensors: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None = None

    @property
    def inputs(self) -> list[torch.Tensor]:
        """The graph inputs this form takes, in order (`apply` reads them back in this order)."""
        return [*self.tensors] + ([] if self.bias is None else [self.bias])

    @property
    def signature(self) -> tuple:
        """What a compiled graph depends on: the formula and its inputs' shapes, strides and dtypes."""
        return (self.kind, self.bias is not None, *((t.shape, t.stride(), t.dtype) for t in self.inputs))

    def apply(self, x: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, Kept]:
        """The formula on x with `inputs` standing for `self.inputs` (graph placeholders when traced)."""
        n = len(self.tensors)
        y, kept = _FORMULAS[self.kind](x, *inputs[:n])
        return (y if self.bias is None else y + inputs[n]), [x, *kept]


def linear_form(module: nn.Module) -> LinearForm | None:
    """`module`'s traceable one-row form on CPU in float32, or None where it has none."""
    if isinstance(module, W8A8Linear):
        return _w8a8_form(module)
    if isinstance(module, W8A16CPULinear):
        if module.path != "gemv":
            return None
        return LinearForm("w8a16", (module.weight, module.weight_scale), module.bias)
    if type(module) is nn.Linear and module.weight.dtype == torch.float32:
        bias = None if module.bias is None else module.bias.detach()
        return LinearForm("float", (module.weight.detach(),), bias)
    return None


def _w8a8_form(module: W8A8Linear) -> LinearForm | None:
    # The paths whose one-row step is the compiled GEMV; fbgemm's 7-bit codes (AVX2) and
    # `fp16codes` compute other numbers or run a library kernel.
    if not (module.path in ("int_mm", "dequant") or module._fbgemm_gemv_row):
        return None
    if module.weight.device.type != "cpu":
        return None
    if module.input_scale is None:
        return LinearForm("w8a8", (module.weight, module.weight_scale), module.bias)
    return LinearForm("w8a8_static", (module.weight, module.weight_scale, module.input_scale), module.bias)
