"""Linear layers on tessel kernels: float (`Linear`), W8A8 (`Int8Linear`) and W8A16 (`W8A16Linear`).

All three take inputs [..., in_features] and return [..., out_features] in the input's dtype.
The quantised layers hold int8 weights quantised once per output channel (symmetric absmax/127,
the same rule as `quantize_per_token` applied to the weight's rows):

    Int8Linear:   y = int8_gemm(q_x, q_w, s_x, s_w, bias)  with (q_x, s_x) = quantize_per_token(x)
    W8A16Linear:  y = w8a16_gemm(x, q_w, s_w, bias)   (float32 on a CPU with fbgemm: the codes as
                  float16 in fbgemm's fp16-weight GEMM, `tessel.kernels.int8_cpu`, the same sums)

On CPU, `Int8Linear` takes the int8 path of the CPU it runs on (`choose_int8_path`): `int_mm`
(AMX) as above, `fp16codes` (AVX2: the same codes through fbgemm's fp16-weight GEMM), `fbgemm`
(fbgemm's int8 GEMM on the same per-token codes where they cannot saturate: the default on AVX-512
VNNI, and on AVX2 when the weight codes fit 7 bits, `from_linear(layer, weight_code_bits=7)`; 7-bit
activation codes for full-range weights on AVX2, opt-in; both `tessel.kernels.int8_cpu`),
`dequant` (the integer codes as a float32 GEMM).
"""

from __future__ import annotations

import torch
from torch import nn

from tessel.errors import TesselError
from tessel.kernels._dispatch import use_triton
from tessel.kernels.int8_cpu import (
    fbgemm_linear,
    fbgemm_pack,
    fits_7bit_codes,
    fp16_codes_linear,
    fp16_codes_matmul,
    fp16_codes_pack,
)
from tessel.kernels.int8_gemm import int8_epilogue, int8_gemm
from tessel.kernels.quantize import quantize_per_token
from tessel.kernels.w8a16_gemm import linear, w8a16_gemm
from tessel.kernels.cpu_features import INT8_PATHS, choose_int8_path, fbgemm_act_bits, fbgemm_available
from tessel.quant.schemes import make_scheme
from tessel.quant.schemes import quantize_weight as quantize_with_scheme


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    if x.shape[-1] != in_features:
        raise TesselError(f"linear layer expects inputs [..., {in_features}]; got {tuple(x.shape)}")
    return x.reshape(-1, in_features)


def quantize_weight(weight: torch.Tensor, code_bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q [N, K] int8, scale [N] float32), weight ~= q * scale[:, None].
    code_bits 7 keeps the codes in [-63, 63] (scale absmax / 63, the quantisation toolkit's
    `--weight-code-bits 7` rounding): fbgemm's int8 GEMM on AVX2 then takes 8-bit activations."""
    if code_bits == 8:
        with torch.no_grad():
            return quantize_per_token(weight.detach().float())
    if code_bits != 7:
        raise TesselError(f"weight code bits must be 8 or 7; got {code_bits}")
    quantized = quantize_with_scheme(weight, make_scheme("w8a8", weight_code_bits=code_bits))
    return quantized.q, quantized.scale.reshape(-1)


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


class Linear(nn.Linear):
    """nn.Linear whose forward runs tessel's GEMM kernel (Triton on CUDA, torch's on CPU).

    Same parameters, state_dict and constructor as nn.Linear, so it loads nn.Linear checkpoints;
    gradients flow through a backward written with torch matmuls.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x, self.in_features)
        out = _LinearFunction.apply(rows, self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> Linear:
        """A tessel Linear sharing `layer`'s parameters."""
        new = cls(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        new.weight = layer.weight
        new.bias = layer.bias
        return new


class _QuantizedLinear(nn.Module):
    """Shared storage of the int8 layers: weight int8 [N, K], weight_scale float32 [N], bias or None."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise TesselError(f"linear layer sizes must be positive; got {in_features} -> {out_features}")
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer(
            "bias", torch.zeros(out_features, dtype=torch.float32, device=device) if bias else None
        )

    @classmethod
    def from_linear(cls, layer: nn.Linear, weight_code_bits: int = 8) -> _QuantizedLinear:
        """Quantise a float nn.Linear once: per-output-channel int8 weights (codes of
        `weight_code_bits`), float32 scales, float32 bias."""
        weight, scale = quantize_weight(layer.weight, weight_code_bits)
        bias = None if layer.bias is None else layer.bias.detach().float()
        return cls.from_int8(weight, scale, bias)

    @classmethod
    def from_int8(
        cls, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> _QuantizedLinear:
        """Wrap already-quantised tensors: weight int8 [N, K], weight_scale [N], bias [N] or None."""
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise TesselError(
                f"{cls.__name__} wants an int8 weight [N, K]; got {weight.dtype} {tuple(weight.shape)}"
            )
        out_features, in_features = weight.shape
        if weight_scale.numel() != out_features:
            raise TesselError(
                f"{cls.__name__} wants {out_features} weight scales; got {weight_scale.numel()}"
            )
        layer = cls(in_features, out_features, bias=bias is not None, device="meta")
        layer.weight = weight.detach().contiguous()
        layer.weight_scale = weight_scale.detach().reshape(out_features).float().contiguous()
        if bias is not None:
            layer.bias = bias.detach().reshape(out_features).float().contiguous()
        return layer

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        """Follow .to(device) / .cuda() but keep scales and bias float32 through .half() / .to(bf16).

        Rounding the per-channel scales to 16 bits would add a systematic error to every output
        of the channel; the kernels take float32 scales and return the input's dtype anyway.
        """
        kept = {
            name: self._buffers[name]
            for name in ("weight_scale", "bias")
            if self._buffers.get(name) is not None
        }
        for name in kept:
            self._buffers[name] = None
        super()._apply(fn, recurse)
        for name, tensor in kept.items():  # the int8 weight has moved to the new device by now
            self._buffers[name] = tensor.to(device=self.weight.device, dtype=torch.float32)
        return self

    _packed: tuple[tuple, object] | None = None  # ((path, weight key), fbgemm's form of the weight)

    def _fbgemm_weight(self, path: str):
        """fbgemm's packed weight for `path` (`fbgemm` or `fp16codes`), packed again whenever the
        weight or its scales changed."""
        key = (path, self.weight.data_ptr(), self.weight._version, self.weight_scale.data_ptr(),
               self.weight_scale._version)  # fmt: skip
        if self._packed is None or self._packed[0] != key:
            packed = (
                fbgemm_pack(self.weight, self.weight_scale)
                if path == "fbgemm"
                else fp16_codes_pack(self.weight)
            )
            self._packed = (key, packed)
        return self._packed[1]

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight these int8 values stand for: weight * weight_scale[:, None]."""
        return self.weight.float() * self.weight_scale[:, None]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class Int8Linear(_QuantizedLinear):
    """W8A8 linear: static per-channel int8 weights, dynamic per-token int8 activations.

    y = (q_x @ q_w.T) * s_x[:, None] * s_w[None, :] + bias, computed as quantize_per_token then
    int8_gemm (int32 accumulation). Output dtype = input dtype (float16, bfloat16 or float32).
    """

    # ((weight key), CPU int8 path, fbgemm's activation bits), chosen again when the weight changes
    _path: tuple[tuple, str, int] | None = None
    _forced: str | None = None  # set_path's choice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x, self.in_features)
        on_cpu_torch = rows.device.type == "cpu" and not use_triton(rows)
        path = self.cpu_path() if on_cpu_torch else "int_mm"  # int8_gemm: Triton, or torch's on CUDA
        if path == "fbgemm":
            act_bits = self._path[2]
            out = fbgemm_linear(rows, self._fbgemm_weight(path), self.bias, act_bits).to(x.dtype)
        else:
            q, scale = quantize_per_token(rows)
            if path == "fp16codes":
                acc = fp16_codes_matmul(q, self._fbgemm_weight(path))
                out = int8_epilogue(acc, scale, self.weight_scale, self.bias, x.dtype)
            elif path == "int_mm":
                out = int8_gemm(q, self.weight, scale, self.weight_scale, self.bias, out_dtype=x.dtype)
            else:  # dequant: exact integer sums in float32 while they stay below 2**24
                acc = q.float() @ self.weight.float().t()
                out = int8_epilogue(acc, scale, self.weight_scale, self.bias, x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def cpu_path(self) -> str:
        """The CPU int8 path: `choose_int8_path` for this weight's codes, chosen at the first call
        and again when the weight changes (TESSEL_INT8_PATH forces one)."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._path is None or self._path[0] != key:
            narrow = fits_7bit_codes(self.weight)
            path = self._forced or choose_int8_path(weights_fit_7bit=narrow)
            self._path = (key, path, fbgemm_act_bits(narrow))
        return self._path[1]

    def set_path(self, path: str | None) -> None:
        """Force a CPU int8 path (one of INT8_PATHS; None: by the CPU and the weight's codes again)."""
        if path is not None and path not in INT8_PATHS:
            raise TesselError(f"unknown int8 path {path!r}; choose one of {', '.join(INT8_PATHS)}")
        self._forced, self._path = path, None


class W8A16Linear(_QuantizedLinear):
    """Weight-only int8 linear: y = x @ (q_w * s_w[:, None]).T + bias, dequantised inside the GEMM."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _rows(x, self.in_features)
        if (
            rows.dtype == torch.float32
            and rows.device.type == "cpu"
            and fbgemm_available()
            and not use_triton(rows)
        ):
            # the int8 codes as float16 in fbgemm's fp16-weight GEMM: the same sums, no float copy per call
            out = fp16_codes_linear(rows, self._fbgemm_weight("fp16codes"), self.weight_scale, self.bias)
        else:
            out = w8a16_gemm(rows, self.weight, self.weight_scale, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)
