"""Int8 weights on x86 CPUs without AVX-512, through fbgemm (PyTorch's CPU low-precision GEMMs).

`torch._int_mm` has no fast kernel on such CPUs (at 256x4096x4096 it ran at 0.04x the speed of a
float32 GEMM on an AVX2-only AMD EPYC, `benchmarks/kernels.py`), and inductor's compiled int8 GEMV
(`tessel.kernels.w8a16_cpu`, fast with AVX-512) loads int8 through a slow partial-vector path
with AVX2 only (`benchmarks/w8a16_cpu_options.py`). Two fbgemm GEMMs are fast there:

fp16 codes. Int8 codes are integers in [-127, 127], exact in float16, so fbgemm's fp16-weight GEMM
(`fbgemm_linear_fp16_weight_fp32_activation`: float32 activations, float32 sums) on the codes
computes what the de-quantised float32 GEMM does while reading 2 bytes per weight. W8A16 applies
the channel scale after it; W8A8 feeds it the per-token int8 codes of the activations (integers
too), so its sums are the int32 GEMM's while they stay below 2**24: the `int_mm` path's numbers.

fbgemm int8 (`quantized.linear_dynamic`), faster still. It quantises its input per tensor to
unsigned codes with a zero point, and AVX2's u8 x s8 multiply-add sums pairs of products into int16:
255 * 127 * 2 overflows it. So either side must give up a bit:

    weights in [-64, 63] (`tessel quantize --weight-code-bits 7`): 8-bit activation codes,
        255 * 64 * 2 = 32640 < 2**15, never saturates (`fits_7bit_codes`; the engine's default then)
    any int8 weights: 7-bit activation codes (`reduce_range`), 128 levels instead of 255 (opt-in)

Per tensor would give every row of a batch the step of the largest row, so each row is divided by
its absmax first; all rows then span [-1, 1] and the step is each row's own (per token, as
`quantize_per_token`):

    y[m, :] = fbgemm(x[m, :] / a[m]) * a[m] + bias        a[m] = max_k |x[m, k]|
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from tessel.kernels.quantize import EPS


def fbgemm_pack(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.ScriptObject:
    """fbgemm's packed form of int8 weights [N, K] with per-output-channel scales [N] (no bias)."""
    zeros = torch.zeros(weight.shape[0], dtype=torch.int64)
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch; fbgemm still needs one
        warnings.simplefilter("ignore")
        torch.backends.quantized.engine = "fbgemm"
        qweight = torch._make_per_channel_quantized_tensor(
            weight.contiguous(), weight_scale.double(), zeros, 0
        )
        return torch.ops.quantized.linear_prepack(qweight, None)


NARROW_CODE_MIN, NARROW_CODE_MAX = -64, 63  # int8 weight codes fbgemm multiplies by 8-bit activations


def fits_7bit_codes(weight: torch.Tensor) -> bool:
    """Whether int8 weight codes lie in [-64, 63], so 8-bit activation codes cannot saturate."""
    return weight.numel() == 0 or (
        int(weight.min()) >= NARROW_CODE_MIN and int(weight.max()) <= NARROW_CODE_MAX
    )


def fbgemm_linear(
    rows: torch.Tensor, packed: torch.ScriptObject, bias: torch.Tensor | None, act_bits: int = 7
) -> torch.Tensor:
    """float32 rows [M, K] through fbgemm's int8 GEMM, each row quantised on its own to `act_bits`
    (8 only for weights that `fits_7bit_codes`) -> float32 [M, N]."""
    if act_bits not in (7, 8):
        raise ValueError(f"fbgemm's activation codes are 7 or 8 bits; got {act_bits}")
    reduce_range = act_bits == 7
    rows = rows.float()
    if rows.shape[0] == 1:  # one row: per tensor is per token already
        out = _quietly(torch.ops.quantized.linear_dynamic, rows, packed, reduce_range)
        return out if bias is None else out.add_(bias)
    absmax = rows.abs().amax(dim=1, keepdim=True).clamp_min_(EPS)
    out = _quietly(torch.ops.quantized.linear_dynamic, rows / absmax, packed, reduce_range)
    out.mul_(absmax)
    return out if bias is None else out.add_(bias)


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
