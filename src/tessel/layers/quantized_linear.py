"""The engine's W8A8 linear: int8 weights per output channel, int8 activations, one int8 GEMM.

    dynamic:  (q_x, s_x) = quantize_per_token(x)                  s_x [M], one scale per token
    static:   q_x = clamp(round(x / s_in), -127, 127), s_x = s_in  s_in: the calibrated input_scale
    y = (q_x @ q_w.T) * s_x[:, None] * s_w[None, :] + bias

A single-row step on CPU (one sequence decoding; on the `int_mm` or `dequant` path, or `fbgemm`
with 8-bit codes on AVX-512) sums the integer products in the compiled int8 GEMV of `gemv_int8`
(float32 sums, exact below 2**24, as the `dequant` path's), which streams the int8 weight faster
than oneDNN's int8 GEMM does at one row.

On CUDA the GEMM is tessel's Triton int8 kernel. On CPU the path follows the CPU
(`tessel.kernels.cpu_features`): `int_mm` (AMX, and static scales on AVX-512 VNNI: `torch._int_mm`),
`fp16codes` (AVX2: the integer codes through fbgemm's fp16-weight GEMM, the same sums), `fbgemm`
(fbgemm's int8 GEMM on the same per-token codes, bit-equal to `int_mm`, where 8-bit codes cannot
saturate: the default on AVX-512 VNNI, and on AVX2 where the weight codes fit 7 bits; 7-bit
activation codes against int16 saturation for full-range weights on AVX2, opt-in; static scales
fall back to `dequant` there; `tessel.kernels.int8_cpu`), `dequant` (the integer products as a
float32 GEMM).

`W8A16CPULinear` is the weight-only scheme's CPU module (`choose_w8a16_path`):

    gemv     rows <= GEMV_MAX_ROWS: y = gemv_int8(x, q_w, s_w, bias) (float32, int8 weights read)
             more rows:            the de-quantised float32 GEMM (oneDNN-packed), as `dequant`
    fp16codes  y = fp16_codes_linear(x, q_w as float16, s_w, bias) (float32 sums, 2 bytes per weight)
    bf16     y = bf16(sum_k bf16(x) * q_w) * s_w + bias (int8 weights for few rows, packed bf16 above)
    dequant  the de-quantised float32 GEMM for every call
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tessel.errors import TesselError
from tessel.kernels.int8_cpu import (
    fbgemm_linear,
    fbgemm_pack,
    fits_7bit_codes,
    fp16_codes_linear,
    fp16_codes_matmul,
    fp16_codes_pack,
)
from tessel.kernels.int8_gemm import int8_epilogue, int8_gemm
from tessel.kernels.quantize import QMAX, quantize_per_token
from tessel.kernels.w8a16_cpu import bf16_gemm, gemv_int8, gemv_int8_scaled, quantize_rows
from tessel.layers.packed_linear import BATCH_HINT, PackedLinear, packing_available
from tessel.kernels.cpu_features import (
    INT8_PATHS,
    W8A16_PATHS,
    avx512_cpu,
    choose_int8_path,
    choose_w8a16_path,
    fbgemm_act_bits,
)

# Rows up to which a decode step reads the int8 weight directly (GEMV) instead of a float GEMM.
# The GEMV re-reads the weight per row, so its lead over the float32 GEMM shrinks with the rows
# and is gone by about 4 (measured over SmolLM2's 120 decoder linears: docs/results.md); each row
# count is a separate compilation (seconds per shape), so only the single-sequence step takes it.
GEMV_MAX_ROWS = 1


class W8A8Linear(nn.Module):
    """y = x @ (q_w * s_w[:, None]).T + bias with x quantised to int8 per token (or by a static scale)."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__()
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise TesselError(
                f"W8A8Linear wants an int8 weight [N, K]; got {weight.dtype} {tuple(weight.shape)}"
            )
        self.out_features, self.in_features = weight.shape
        if weight_scale.numel() != self.out_features:
            raise TesselError(
                f"W8A8Linear wants {self.out_features} weight scales; got {weight_scale.numel()}"
            )
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.reshape(-1).float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.reshape(-1).float().contiguous())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.reshape(1).float())
        self.set_path(path)

    def set_path(self, path: str | None = None) -> None:
        """Pick the CPU int8 path (None: by this CPU's features and the weight's codes) and prepare
        its weight form."""
        on_cpu = self.weight.device.type == "cpu" and not self.weight.is_meta
        narrow = on_cpu and fits_7bit_codes(self.weight)
        self._fbgemm_act_bits = fbgemm_act_bits(narrow)
        if path is None:
            static = self.input_scale is not None
            path = choose_int8_path(weights_fit_7bit=narrow and not static, static_scales=static)
        if path not in INT8_PATHS:
            raise TesselError(f"unknown int8 path {path!r}; choose one of {', '.join(INT8_PATHS)}")
        if path == "fbgemm" and self.input_scale is not None:
            path = "dequant"  # fbgemm's dynamic linear cannot take a calibrated input scale
        self.path = path
        # One row on AVX-512 (VNNI): the compiled GEMV, faster there in the engine than fbgemm's
        # one-row GEMM (benchmarks/quant.py, `w8a8 rtn int_mm int8-head`), and the same codes.
        # Inductor's GEMV is slow without AVX-512, where fbgemm keeps the row.
        self._fbgemm_gemv_row = path == "fbgemm" and self._fbgemm_act_bits == 8 and avx512_cpu()
        self._packed = self._float_weight = None
        if not on_cpu:
            return
        if path == "fbgemm":
            self._packed = fbgemm_pack(self.weight, self.weight_scale)
        elif path == "fp16codes":
            self._packed = fp16_codes_pack(self.weight)
        elif path == "dequant":
            self._float_weight = self.weight.float()

    def _quantize_input(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_scale is None:
            return quantize_per_token(rows)
        s = self.input_scale
        q = torch.round(rows.float() / s).clamp_(-QMAX, QMAX).to(torch.int8)
        return q, s.expand(rows.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        one_row_gemv = self.path in ("int_mm", "dequant") or self._fbgemm_gemv_row
        if one_row_gemv and not rows.is_cuda and 0 < rows.shape[0] <= GEMV_MAX_ROWS:
            out = self._gemv(rows)  # a decode step of one sequence: the hot path
            if out is not None:
                return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if rows.is_cuda or self.path == "int_mm":
            q, s = self._quantize_input(rows)
            out = int8_gemm(q, self.weight, s, self.weight_scale, self.bias, out_dtype=x.dtype)
        elif self.path == "fbgemm":
            out = fbgemm_linear(rows, self._packed, self.bias, self._fbgemm_act_bits).to(x.dtype)
        elif self.path == "fp16codes":
            quantized = None
            if self.input_scale is None and 0 < rows.shape[0] <= GEMV_MAX_ROWS:  # one compiled kernel
                quantized = quantize_rows(rows)
            codes, s = quantized if quantized is not None else self._quantize_input(rows)
            acc = fp16_codes_matmul(codes, self._packed)
            out = int8_epilogue(acc, s, self.weight_scale, self.bias, x.dtype)
        else:
            q, s = self._quantize_input(rows)
            out = (q.float() @ self._float_weight.t()).mul_(s[:, None]).mul_(self.weight_scale)
            out = (out if self.bias is None else out.add_(self.bias)).to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _gemv(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The integer products of a single row summed by a compiled int8 GEMV, then `int8_gemm`'s
        epilogue (in the same kernel when there is no bias): equal to the int32 GEMM while every
        partial sum stays below 2**24 in magnitude (float32 holds those integers exactly); None
        without a compiler."""
        quantized = quantize_rows(rows) if self.input_scale is None else None  # one compiled kernel
        if quantized is None:
            q, s = self._quantize_input(rows)
            quantized = q.float(), s
        codes, scales = quantized
        if self.bias is None:  # the epilogue fused in (bit-equal; with a bias it was not)
            return gemv_int8_scaled(codes, self.weight, scales, self.weight_scale)
        acc = gemv_int8(codes, self.weight, _unit_scales(self.out_features))
        if acc is None:
            return None
        return int8_epilogue(acc, scales, self.weight_scale, self.bias, torch.float32)

    def extra_repr(self) -> str:
        act = "dynamic per token" if self.input_scale is None else "static per tensor"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, act={act}, path={self.path}"
        )


class W8A16CPULinear(nn.Module):
    """y = x @ (q_w * s_w[:, None]).T + bias on CPU, float32 in and out; the path by the CPU (see above)."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__()
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise TesselError(
                f"W8A16CPULinear wants an int8 weight [N, K]; got {weight.dtype} {tuple(weight.shape)}"
            )
        self.out_features, self.in_features = weight.shape
        if weight_scale.numel() != self.out_features:
            raise TesselError(
                f"W8A16CPULinear wants {self.out_features} weight scales; got {weight_scale.numel()}"
            )
        self.weight = weight.contiguous()
        self.weight_scale = weight_scale.reshape(-1).float().contiguous()
        self.bias = None if bias is None else bias.reshape(-1).float().contiguous()
        self.set_path(path)

    def set_path(self, path: str | None = None) -> None:
        """Pick the path (None: by this CPU) and build the weight form it needs besides the int8 one."""
        path = choose_w8a16_path() if path is None else path
        if path not in W8A16_PATHS:
            raise TesselError(f"unknown W8A16 path {path!r}; choose one of {', '.join(W8A16_PATHS)}")
        self.path = path
        self._float = self._bf16 = self._fp16_codes = None
        if path == "fp16codes":
            self._fp16_codes = fp16_codes_pack(self.weight)
        elif path == "bf16":
            w16 = self.weight.to(torch.bfloat16)
            packed = packing_available()
            self._bf16 = torch.ops.mkldnn._reorder_linear_weight(w16, BATCH_HINT) if packed else w16
        else:
            w = self.weight.float().mul_(self.weight_scale[:, None])
            self._float = (
                PackedLinear(w, self.bias)
                if packing_available()
                else functools.partial(F.linear, weight=w, bias=self.bias)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        decode_step = x.dim() == 2 and x.dtype == torch.float32 and 0 < x.shape[0] <= GEMV_MAX_ROWS
        if self.path == "gemv" and decode_step:
            out = gemv_int8(x, self.weight, self.weight_scale, self.bias)  # a decode step: the hot path
            if out is not None:
                return out
        rows = x.reshape(-1, self.in_features).float()
        out = None
        if self.path == "fp16codes":
            out = fp16_codes_linear(rows, self._fp16_codes, self.weight_scale, self.bias)
        elif self.path == "bf16":
            out = bf16_gemm(rows, self.weight, self._bf16, self.weight_scale, self.bias, GEMV_MAX_ROWS)
        elif self.path == "gemv" and 0 < rows.shape[0] <= GEMV_MAX_ROWS:
            out = gemv_int8(rows, self.weight, self.weight_scale, self.bias)
        if out is None:
            out = self._float(rows)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, path={self.path}"


@functools.lru_cache(maxsize=64)
def _unit_scales(n: int) -> torch.Tensor:
    return torch.ones(n)


def dequantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    """A float nn.Linear holding the dequantised weight (weight-only schemes on CPU)."""
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=dtype)
    layer.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return layer
