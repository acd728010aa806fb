"""Int8 weights on x86 CPUs without AVX-512, through fbgemm (PyTorch's CPU low-precision GEMMs).

`torch._int_mm` has no fast kernel on such CPUs (far slower than a float32 GEMM on an AVX2-only
AMD EPYC, `benchmarks/kernels.py`), and inductor's compiled int8 GEMV
(`tessel.kernels.w8a16_cpu`, fast with AVX-512) loads int8 through a slow partial-vector path
with AVX2 only (`benchmarks/w8a16_cpu_options.py`). Two fbgemm GEMMs are fast there:

fp16 codes. Int8 codes are integers in [-127, 127], exact in float16, so fbgemm's fp16-weight GEMM
(`fbgemm_linear_fp16_weight_fp32_activation`: float32 activations, float32 sums) on the codes
computes what the de-quantised float32 GEMM does while reading 2 bytes per weight. W8A16 applies
the channel scale after it; W8A8 feeds it the per-token int8 codes of the activations (integers
too), so its sums are the int32 GEMM's while they stay below 2**24: the `int_mm` path's numbers.

fbgemm int8, faster still. It multiplies unsigned activation codes (with a zero point) by the
signed weight codes. AVX2's u8 x s8 multiply-add sums pairs of products into int16, and
255 * 127 * 2 overflows it; AVX-512 VNNI's vpdpbusd sums single products into int32 and cannot.
So on AVX2 either side must give up a bit:

    weights in [-64, 63] (the quantize command's `--weight-code-bits 7`): 8-bit activation codes,
        255 * 64 * 2 = 32640 < 2**15, never saturates (`fits_7bit_codes`; the engine's default then)
    any int8 weights: 7-bit activation codes (`reduce_range`), 128 levels instead of 255 (opt-in)

8-bit activation codes (AVX2 with 7-bit weights, every weight on VNNI) are `quantize_per_token`'s
own: each row is divided by its scale a[m] = max_k |x[m, k]| / 127, and fbgemm's int8 linear with a
given input quantisation (scale 1, zero point 128: code = round(x / a) + 128) multiplies those
integers exactly. The weight is packed with unit scales, so the GEMM returns the integer sums, and
`int8_gemm`'s own epilogue scales them: bit-equal to the int32 GEMM path (`int_mm`):

    y[m, :] = (fbgemm_q(round(x[m, :] / a[m])) * a[m]) * w_scale + bias

7-bit codes go through fbgemm's dynamic linear (`quantized.linear_dynamic`), which quantises its
input per tensor; each row is divided by its absmax first so every row spans [-1, 1] and keeps
its own step (per token):

    y[m, :] = fbgemm_dynamic(x[m, :] / b[m]) * w_scale * b[m] + bias        b[m] = max_k |x[m, k]|
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from tessel.kernels.int8_gemm import int8_epilogue
from tessel.kernels.quantize_rows import EPS, per_token_codes


@dataclass(frozen=True, slots=True)
class FbgemmInt8:
    """Int8 weights [N, K] packed by fbgemm with unit scales, so its GEMM returns the integer sums
    (exact in float32 below 2**24), and the per-output-channel scales applied after."""

    packed: torch.ScriptObject  # fbgemm's opaque packed matrix
    weight_scale: torch.Tensor  # float32 [N]


def fbgemm_pack(weight: torch.Tensor, weight_scale: torch.Tensor) -> FbgemmInt8:
    """fbgemm's packed form of int8 weights [N, K] with per-output-channel scales [N] (no bias)."""
    n = weight.shape[0]
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch; fbgemm still needs one
        warnings.simplefilter("ignore")
        torch.backends.quantized.engine = "fbgemm"
        qweight = torch._make_per_channel_quantized_tensor(
            weight.contiguous(), torch.ones(n, dtype=torch.float64), torch.zeros(n, dtype=torch.int64), 0
        )
        packed = torch.ops.quantized.linear_prepack(qweight, None)
    return FbgemmInt8(packed, weight_scale.reshape(-1).float().contiguous())


NARROW_CODE_MIN, NARROW_CODE_MAX = -64, 63  # int8 weight codes fbgemm multiplies by 8-bit activations


def fits_7bit_codes(weight: torch.Tensor) -> bool:
    """Whether int8 weight codes lie in [-64, 63], so 8-bit activation codes cannot saturate."""
    return weight.numel() == 0 or (
        int(weight.min()) >= NARROW_CODE_MIN and int(weight.max()) <= NARROW_CODE_MAX
    )


def fbgemm_linear(
    rows: torch.Tensor, weight: FbgemmInt8, bias: torch.Tensor | None, act_bits: int = 7
) -> torch.Tensor:
    """float32 rows [M, K] through fbgemm's int8 GEMM, each row quantised on its own to `act_bits`
    -> float32 [M, N]. 8: `quantize_per_token`'s codes and `int8_gemm`'s epilogue, bit-equal to
    the int32 GEMM path (only where the codes cannot saturate); 7: fbgemm's dynamic quantisation."""
    if act_bits not in (7, 8):
        raise ValueError(f"fbgemm's activation codes are 7 or 8 bits; got {act_bits}")
    rows = rows.float()
    if act_bits == 8 and fbgemm_takes_codes():
        codes, scale = per_token_codes(rows)
        return int8_epilogue(fbgemm_int8_sums(codes, weight), scale, weight.weight_scale, bias, torch.float32)
    absmax = None if rows.shape[0] == 1 else rows.abs().amax(dim=1, keepdim=True).clamp_min_(EPS)
    if absmax is not None:  # one row: per tensor is per token already
        rows = rows / absmax
    out = _quietly(torch.ops.quantized.linear_dynamic, rows, weight.packed, act_bits == 7)
    out.mul_(weight.weight_scale)
    if absmax is not None:
        out.mul_(absmax)
    return out if bias is None else out.add_(bias)


UINT8_ZERO_POINT = 128  # signed codes in [-127, 127] as fbgemm's unsigned activations: [1, 255]


@functools.cache
def _given_qparams_linear():
    """fbgemm's int8 linear on float rows quantised by a given scale and zero point, float32 out
    (None in a torch build without it: the dynamic linear runs instead)."""
    try:
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
    except (AttributeError, RuntimeError):
        return None


def fbgemm_takes_codes() -> bool:
    """Whether this torch build's fbgemm multiplies given 8-bit codes (`fbgemm_int8_sums`)."""
    return _given_qparams_linear() is not None


def fbgemm_int8_sums(codes: torch.Tensor, weight: FbgemmInt8) -> torch.Tensor:
    """codes [M, K] (float32 integers in [-127, 127], `quantize_per_token`'s) @ weight.T -> the
    integer sums as float32 [M, N], by fbgemm's int8 GEMM (only where `fbgemm_takes_codes`).
    The codes are rounded by the caller, not by fbgemm: it adds the zero point before rounding,
    and 36.500008 + 128 rounds to the tie 164.5 in float32, then to even: 36 where
    quantize_per_token gives 37."""
    return _quietly(_given_qparams_linear(), codes, 1.0, UINT8_ZERO_POINT, weight.packed)


@dataclass(frozen=True, slots=True)
class FP16Codes:
    """Int8 weights [N, K] packed by fbgemm as float16 codes (exact), with a zero bias of N."""

    packed: torch.Tensor  # fbgemm's opaque packed matrix
    zeros: torch.Tensor  # float32 [N]: fbgemm's GEMM takes a bias; the real one is added after


def fp16_codes_pack(weight: torch.Tensor) -> FP16Codes:
    """fbgemm's packed float16 form of int8 weights [N, K]: the integer codes, exact in float16."""
    with warnings.catch_warnings():  # deprecated in torch 2.13 like all of fbgemm's float16 ops
        warnings.simplefilter("ignore")
        packed = torch.fbgemm_pack_gemm_matrix_fp16(weight.float())
    return FP16Codes(packed, torch.zeros(weight.shape[0]))


def fp16_codes_matmul(rows: torch.Tensor, codes: FP16Codes) -> torch.Tensor:
    """rows [M, K] @ codes.T -> float32 [M, N] by fbgemm's fp16-weight GEMM (float32 activations
    and sums): with integer rows (W8A8's quantised activations) the sums are the int32 GEMM's
    while they stay below 2**24 in magnitude, as on the `dequant` path."""
    return _quietly(torch.fbgemm_linear_fp16_weight_fp32_activation, rows.float(), codes.packed, codes.zeros)


_QUIETED: set[object] = set()


def _quietly(op, *args):
    """`op(*args)`, its deprecation warning silenced. torch warns once per process, on the first
    call, so only that call pays for `warnings.catch_warnings` (a few microseconds, as much as a
    small decode-step GEMM)."""
    if op in _QUIETED:
        return op(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = op(*args)
    _QUIETED.add(op)
    return out


def fp16_codes_linear(
    rows: torch.Tensor, codes: FP16Codes, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """W8A16 with float32 activations: (rows @ codes.T) * weight_scale + bias, the scale in float32.
    The de-quantised float32 GEMM's numbers (to float32 rounding), half its weight bytes."""
    out = fp16_codes_matmul(rows, codes).mul_(weight_scale)
    return out if bias is None else out.add_(bias)
