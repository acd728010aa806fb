"""W8A8: int8 weights per output channel, int8 activations, one int8 GEMM. The engine's layer for
w8a8 checkpoints and plans, and the int8 LM head of a w8a8 model.

    dynamic:  (codes, s_x) = per-token codes of x (`quantize_per_token`)   s_x [M], one scale per token
    static:   codes = clamp(round(x / s_in), -127, 127), s_x = s_in        s_in: the calibrated input_scale
    y = (codes @ q_w.T) * s_x[:, None] * s_w[None, :] + bias                (`int8_epilogue`)

Every path computes that formula: the quantiser, the path's integer sums, the epilogue. On CUDA
(or with Triton forced) the whole of it is tessel's `int8_gemm`. On CPU the path follows the CPU
(`tessel.kernels.cpu_features.choose_int8_path`), chosen once per weight:

    int_mm     `int8_gemm`'s CPU side: `torch._int_mm` (AMX; AVX-512 VNNI with static scales)
    fp16codes  the integer codes through fbgemm's fp16-weight GEMM, the same sums (AVX2)
    fbgemm     fbgemm's int8 GEMM on the same per-token codes, bit-equal to `int_mm`, where 8-bit
               codes cannot saturate (AVX-512 VNNI; AVX2 with weight codes of 7 bits); on AVX2
               with full-range weights, opt-in, fbgemm's own 7-bit activation codes
               (`tessel.kernels.int8_cpu`); static scales take `dequant` instead
    dequant    the integer products as a float32 GEMM (exact below 2**24)

A single row on CPU (one sequence decoding) whose GEMM reads per-token codes (fbgemm8, fp16codes;
dynamic activations) sums its integer products in tessel's int8 GEMV (`tessel.kernels.int8_gemv`,
exact int32 sums, AVX-512 VNNI or AVX2), on the weight packed for it once (`plan.row_kernel`). Else,
on `int_mm`, `dequant`, or `fbgemm` with 8-bit codes on AVX-512, in the compiled int8 GEMV of
`tessel.kernels.w8a16_cpu` (float32 sums, exact below 2**24), which streams the weight faster than a
GEMM at one row. Either GEMV is the layer's traced one-row form (`one_row_form`). fbgemm8 and
fp16codes split around their GEMM at more rows (`split`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tessel.errors import TesselError
from tessel.kernels.cpu_features import INT8_PATHS, avx512_cpu, choose_int8_path, fbgemm_act_bits
from tessel.kernels.dispatch import use_triton
from tessel.kernels.int8_cpu import (
    FbgemmInt8,
    FP16Codes,
    fbgemm_int8_sums,
    fbgemm_linear,
    fbgemm_pack,
    fbgemm_takes_codes,
    fits_7bit_codes,
    fp16_codes_matmul,
    fp16_codes_pack,
)
from tessel.kernels.int8_gemm import int8_epilogue, int8_gemm
from tessel.kernels.int8_gemv import PackedInt8
from tessel.kernels.int8_gemv import gemv_sums as int8_gemv_sums
from tessel.kernels.int8_gemv import pack as pack_int8_gemv
from tessel.kernels.quantize_rows import per_token_codes, quantize_per_token, static_codes
from tessel.kernels.w8a16_cpu import gemv_int8, gemv_int8_scaled, quantize_rows
from tessel.layers.linear.forms import LinearForm, SplitLinear
from tessel.layers.linear.int8_weights import GEMV_MAX_ROWS, Int8Weights, rows_of


@dataclass(frozen=True, slots=True)
class W8A8Path:
    """The path a W8A8 layer takes, and the weight form it reads."""

    name: str  # one of INT8_PATHS (`int_mm` on CUDA: `int8_gemm`)
    on_cpu: bool  # False: CUDA, or Triton forced on CPU tensors (`int8_gemm` does everything)
    fbgemm_act_bits: int = 8  # fbgemm's activation codes: 7 where 8 could saturate (AVX2)
    one_row_gemv: bool = False  # a single CPU row takes the compiled GEMV
    packed: FbgemmInt8 | FP16Codes | None = None  # fbgemm / fp16codes: fbgemm's form of the weight
    float_weight: torch.Tensor | None = None  # dequant: the codes as float32
    # the GEMM reads the per-token codes (`fbgemm8` or `fp16codes`: what `split` calls between
    # its graphs), or None: it quantises the rows itself (fbgemm's 7-bit codes), or `int8_gemm`
    codes_gemm: str | None = None
    # a single row's codes take tessel's int8 GEMV (`tessel.kernels.int8_gemv`) on this packed form
    row_kernel: PackedInt8 | None = None


class W8A8Linear(Int8Weights):
    """y = x @ (q_w * s_w[:, None]).T + bias with x quantised to int8 per token (or by a static scale)."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(weight, weight_scale, bias)
        scale = None if input_scale is None else input_scale.detach().reshape(1).float()
        self.register_buffer("input_scale", scale)
        self.set_path(path)

    # ---- the path, chosen once ------------------------------------------------------------------
    def set_path(self, path: str | None = None) -> None:
        """Force a CPU int8 path (one of INT8_PATHS), or None: by this CPU's features and the
        weight's codes (TESSEL_INT8_PATH forces one); the weight form it reads is built now."""
        if path is not None and path not in INT8_PATHS:
            raise TesselError(f"unknown int8 path {path!r}; choose one of {', '.join(INT8_PATHS)}")
        self._forced = path
        self._prepare()

    def _prepare(self) -> None:
        w = self.weight
        if w.is_meta or w.is_cuda or use_triton(w):
            self.plan = W8A8Path("int_mm", on_cpu=False)
            return
        narrow, static = fits_7bit_codes(w), self.input_scale is not None
        path = self._forced or choose_int8_path(weights_fit_7bit=narrow and not static, static_scales=static)
        if path == "fbgemm" and static:
            path = "dequant"  # fbgemm's dynamic linear cannot take a calibrated input scale
        act_bits = fbgemm_act_bits(narrow)
        # One row: the compiled GEMV, faster than a one-row GEMM, on `int_mm` and `dequant`, and on
        # `fbgemm` with 8-bit codes where the CPU has AVX-512 (the same codes); inductor's GEMV is
        # slow without AVX-512, where fbgemm keeps the row.
        gemv = path in ("int_mm", "dequant") or (path == "fbgemm" and act_bits == 8 and avx512_cpu())
        packed = fbgemm_pack(w, self.weight_scale) if path == "fbgemm" else None
        packed = fp16_codes_pack(w) if path == "fp16codes" else packed
        float_weight = w.float() if path == "dequant" else None
        fbgemm8 = path == "fbgemm" and act_bits == 8 and fbgemm_takes_codes()
        codes_gemm = "fbgemm8" if fbgemm8 else "fp16codes" if path == "fp16codes" else None
        # Where the GEMM reads per-token codes, one row's codes take tessel's int8 GEMV instead
        # (the same integer sums), also in the compiled one-row step (`one_row_form`).
        row_kernel = pack_int8_gemv(w) if codes_gemm is not None and not static else None
        gemv = gemv and row_kernel is None
        self.plan = W8A8Path(path, True, act_bits, gemv, packed, float_weight, codes_gemm, row_kernel)

    @property
    def path(self) -> str:
        return self.plan.name

    def cpu_path(self) -> str:
        """The path a CPU call takes (`path`)."""
        return self.plan.name

    # ---- the formula ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = rows_of(x, self.in_features)
        return self._rows(rows, x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _rows(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        plan = self.plan
        if plan.one_row_gemv and 0 < rows.shape[0] <= GEMV_MAX_ROWS:
            out = self._gemv(rows)  # a decode step of one sequence: the hot path
            if out is not None:
                return out.to(dtype)
        if not plan.on_cpu or plan.name == "int_mm":
            q, s = self._quantize_input(rows)
            return int8_gemm(q, self.weight, s, self.weight_scale, self.bias, out_dtype=dtype)
        if plan.name == "fbgemm" and plan.codes_gemm is None:  # fbgemm quantises the rows itself
            return fbgemm_linear(rows, plan.packed, self.bias, plan.fbgemm_act_bits).to(dtype)
        codes, s = self._codes(rows, compiled=plan.name == "fp16codes" or plan.row_kernel is not None)
        return int8_epilogue(self._sums(codes), s, self.weight_scale, self.bias, dtype)

    def _codes(self, rows: torch.Tensor, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The activations' int8 codes as float32 integers, and their scale per row; `compiled`:
        a single row by the compiled quantiser (one kernel) where there is one."""
        if self.input_scale is not None:
            return static_codes(rows, self.input_scale)
        if compiled and 0 < rows.shape[0] <= GEMV_MAX_ROWS:
            quantized = quantize_rows(rows)
            if quantized is not None:
                return quantized
        return per_token_codes(rows)

    def _quantize_input(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes as int8, for `int8_gemm` (per token: its own quantiser, Triton on CUDA)."""
        if self.input_scale is None:
            return quantize_per_token(rows)
        codes, s = static_codes(rows, self.input_scale)
        return codes.to(torch.int8), s

    def _sums(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [M, K] @ q_w.T as float32 [M, N] by the CPU path's GEMM (exact integers below 2**24),
        or one row by tessel's int8 GEMV (exact int32 sums) where the layer packed its weight for it."""
        plan = self.plan
        if plan.row_kernel is not None and codes.shape[0] == 1:
            return int8_gemv_sums(codes, plan.row_kernel)
        if plan.name == "fbgemm":
            return fbgemm_int8_sums(codes, plan.packed)
        if plan.name == "fp16codes":
            return fp16_codes_matmul(codes, plan.packed)
        return codes @ plan.float_weight.t()

    def _gemv(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The integer products of a single row summed by a compiled int8 GEMV, then `int8_gemm`'s
        epilogue (in the same kernel when there is no bias): equal to the int32 GEMM while every
        partial sum stays below 2**24 in magnitude (float32 holds those integers exactly); None
        without a compiler."""
        codes, scales = self._codes(rows, compiled=True)
        if self.bias is None:  # the epilogue fused in (bit-equal; with a bias it was not)
            return gemv_int8_scaled(codes, self.weight, scales, self.weight_scale)
        acc = gemv_int8(codes, self.weight, _unit_scales(self.out_features))
        if acc is None:
            return None
        return int8_epilogue(acc, scales, self.weight_scale, self.bias, torch.float32)

    # ---- the forms the compiled decode steps trace ----------------------------------------------
    def one_row_form(self) -> LinearForm | None:
        """The one-row GEMV's formula: tessel's int8 GEMV where the layer takes it, else inductor's;
        None on the paths whose row runs fbgemm's or the fp16 GEMM."""
        kernel = self.plan.row_kernel
        if kernel is not None:
            return LinearForm("w8a8_int8_gemv", (kernel.packed, kernel.wsum128, self.weight_scale), self.bias)
        if not self.plan.one_row_gemv:
            return None
        if self.input_scale is None:
            return LinearForm("w8a8", (self.weight, self.weight_scale), self.bias)
        return LinearForm("w8a8_static", (self.weight, self.weight_scale, self.input_scale), self.bias)

    def split(self) -> SplitLinear:
        """Quantiser | integer sums | epilogue where the GEMM reads per-token codes; else opaque."""
        kind = self.plan.codes_gemm if self.input_scale is None else None
        if kind is None:
            return SplitLinear.opaque(self)
        weights = (self.weight_scale,) + (() if self.bias is None else (self.bias,))
        return SplitLinear(kind, self._sums, weights)

    def extra_repr(self) -> str:
        act = "dynamic per token" if self.input_scale is None else "static per tensor"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, act={act}, path={self.path}"
        )


@functools.lru_cache(maxsize=64)
def _unit_scales(n: int) -> torch.Tensor:
    return torch.ones(n)
