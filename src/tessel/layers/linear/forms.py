"""The two forms a linear layer offers the compiled CPU decode steps, beside its eager forward.

One row (`layer.one_row_form()` -> `LinearForm`, the CPU decode graph's one row): the layer's
formula for a float32 row x [1, K] as a function inductor can trace, with the same functions its
own one-row forward compiles (`tessel.kernels.w8a16_cpu`):

    w8a8      codes, s = per_token_codes(x) (dynamic) or static_codes(x, s_in) (static)
              y = (sum_k codes[k] * q_w[n, k]) * s * s_w[n] (+ bias)       float32 sums, exact < 2**24
    w8a8_int8_gemv  the same with dynamic codes, the sums by tessel's int8 GEMV operator
              (`tessel.kernels.int8_gemv`, exact int32 sums) on the weight packed for it
    w8a16     y = (sum_k x[k] * q_w[n, k]) * s_w[n] (+ bias)
    float     y = x @ w.T (+ bias)

`apply` returns (y, kept): `kept` are the row x and W8A8's codes, which the graph must store.
Inductor otherwise inlines a pointwise producer into the reduction that reads it, recomputing the
codes (or the SiLU before the down projection) for every output channel, several times slower
(`benchmarks/decode_graph.py`). Returned as graph outputs, they are stored once. A layer whose
one-row step calls a library kernel a graph cannot hold (fbgemm, oneDNN's packed weight,
bfloat16's `_weight_int8pack_mm`) has none (None).

Several rows (`layer.split()` -> `SplitLinear`, the CPU decode graph's other steps): the forward
split around its library GEMM call, which the graphs on either side cannot hold:

    pre(x)             traced   -> (what the call reads, what the epilogue carries)
    call(inputs)       eager    -> the GEMM's output
    post(acc, carried) traced   -> y

    fbgemm8   W8A8 on fbgemm with 8-bit activation codes (AVX-512 VNNI's default), and
    fp16codes W8A8 on `fp16codes` (AVX2's default), both with dynamic activations:
              pre = `per_token_codes`, call = the layer's integer sums (fbgemm's int8 GEMM, or its
              fp16-weight GEMM on the codes), post = `int8_epilogue`: the layer's own forward
    opaque    any other module: pre = x, call = module(x), post = y

`linear_form(module)` and `split_linear(module)` ask any module, a plain `nn.Linear` included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tessel.kernels.int8_gemm import int8_epilogue
from tessel.kernels.quantize_rows import per_token_codes, static_codes
from tessel.kernels.w8a16_cpu import gemv_formula, gemv_scaled_formula

Kept = list[torch.Tensor]


def _w8a8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, Kept]:
    codes, scale = per_token_codes(x)
    return gemv_scaled_formula(codes, w, scale, w_scale), [codes]


def _w8a8_static(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, input_scale: torch.Tensor
) -> tuple[torch.Tensor, Kept]:
    codes, scale = static_codes(x, input_scale)
    return gemv_scaled_formula(codes, w, scale, w_scale), [codes]


def _w8a8_int8_gemv(
    x: torch.Tensor, packed: torch.Tensor, wsum128: torch.Tensor, w_scale: torch.Tensor
) -> tuple[torch.Tensor, Kept]:
    codes, scale = per_token_codes(x)
    acc = torch.ops.tessel.int8_gemv_sums(codes, packed, wsum128, w_scale.shape[0])
    return (acc * scale[:, None]) * w_scale, [codes]  # `int8_epilogue`'s order, as gemv_scaled_formula


def _w8a16(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, Kept]:
    return gemv_formula(x, w, w_scale), []


def _float(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, Kept]:
    return x @ w.t(), []


_FORMULAS = {
    "w8a8": _w8a8,
    "w8a8_static": _w8a8_static,
    "w8a8_int8_gemv": _w8a8_int8_gemv,
    "w8a16": _w8a16,
    "float": _float,
}


@dataclass(frozen=True, slots=True)
class LinearForm:
    """y = FORMULA[kind](x, *tensors) (+ bias): the layer's one-row numbers, traceable."""

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


def float_form(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearForm | None:
    """The one-row form of a float linear: float32 weights on the CPU only."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    return LinearForm("float", (weight.detach(),), None if bias is None else bias.detach())


@dataclass(frozen=True, slots=True)
class SplitLinear:
    """`post(call(pre(x)))` is the module's forward on rows x [M, K]; `weights` are post's tensors
    (the weight scales, then the bias if any)."""

    kind: str  # "fbgemm8" | "fp16codes" | "opaque"
    gemm: Callable[[torch.Tensor], torch.Tensor]  # the eager call on pre's one output (opaque: the module)
    weights: tuple[torch.Tensor, ...] = ()
    signature: tuple = ()  # what a graph holding `pre` or `post` depends on (set at construction)

    def __post_init__(self) -> None:
        # worked out once: the batch step looks it up for each of its graph calls
        signature = (self.kind, *((t.shape, t.dtype) for t in self.weights))
        object.__setattr__(self, "signature", signature)

    @classmethod
    def opaque(cls, module: nn.Module) -> SplitLinear:
        return cls("opaque", module)

    @property
    def traced_pre(self) -> bool:
        """Whether `pre` computes anything (an opaque linear's call reads x itself)."""
        return self.kind != "opaque"

    @property
    def num_carried(self) -> int:
        """How many tensors `pre` hands to `post` besides the call's one input."""
        return 0 if self.kind == "opaque" else 1

    def pre(self, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the call's inputs, the tensors `post` takes besides the GEMM's output); traceable."""
        if self.kind == "opaque":
            return [x], []
        codes, scale = per_token_codes(x)
        return [codes], [scale]

    def call(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """The library GEMM, eager, on the rows `pre` gave (contiguous)."""
        return self.gemm(inputs[0])

    def post(
        self, acc: torch.Tensor, carried: list[torch.Tensor], weights: list[torch.Tensor]
    ) -> torch.Tensor:
        """y from the GEMM's output; `weights` stand for `self.weights` (placeholders when traced)."""
        if self.kind == "opaque":
            return acc
        bias = weights[1] if len(weights) > 1 else None
        return int8_epilogue(acc, carried[0], weights[0], bias, torch.float32)


class TracedForms:
    """What a linear of the family offers the compiled decode steps (none, unless it says so)."""

    def one_row_form(self) -> LinearForm | None:
        return None

    def split(self) -> SplitLinear:
        return SplitLinear.opaque(self)  # type: ignore[arg-type]


def linear_form(module: nn.Module) -> LinearForm | None:
    """`module`'s traceable one-row form on CPU in float32, or None where it has none."""
    if isinstance(module, TracedForms):
        return module.one_row_form()
    if type(module) is nn.Linear:
        return float_form(module.weight, module.bias)
    return None


def split_linear(module: nn.Module) -> SplitLinear:
    """`module`'s split form: fbgemm8 or fp16codes where a W8A8 layer offers one, else opaque."""
    return module.split() if isinstance(module, TracedForms) else SplitLinear.opaque(module)
