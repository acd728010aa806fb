"""W8A8 GEMM: int8 activations x int8 weights, int32 accumulation, scales fused in the epilogue.

    out[m, n] = (sum_k a[m, k] * w[n, k]) * a_scale[m] * w_scale[n] + bias[n]

`a` holds per-token quantised activations (`quantize_per_token`), `w` per-output-channel quantised
weights in nn.Linear's [N, K] layout. The integer dot product is exact (int32); the float epilogue
runs in float32 and rounds once to `out_dtype`. The Triton kernel is `tessel.kernels.gemm`'s.
"""

from __future__ import annotations

import torch

from tessel.errors import TesselError
from tessel.kernels.autotune import INT8_GEMM_CONFIGS, INTERPRETER_CONFIG, Autotuner, bucket_m, shape_key
from tessel.kernels.cpu_features import int_mm_fast
from tessel.kernels.dispatch import use_triton
from tessel.kernels.gemm import gemm_triton

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def int8_tensor_cores(device: torch.device) -> bool:
    """Whether Triton's int8 tl.dot compiles here: sm_80+ (A100, L4, H100) yes; sm_70/sm_75 (V100,
    T4) no (Triton 3.9 fails in TritonGPUAccelerateMatmul), so there the kernel multiplies the int8
    tiles as fp16 (exact values) with fp32 accumulation: exact while |sum| < 2**24, else ~1e-7 relative.
    The interpreter (CPU tensors) runs the int8 dot."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 8


_TUNER = Autotuner("int8_gemm", INT8_GEMM_CONFIGS, default=INTERPRETER_CONFIG)


def _int8_gemm_torch(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    if a.is_cuda and (a.shape[0] <= 16 or a.shape[1] % 8 or w.shape[0] % 8):
        # CUDA's _int_mm wants M > 16 and K, N multiples of 8; exact int32 via float64 otherwise.
        acc = (a.double() @ w.double().t()).to(torch.int32)
    elif a.is_cuda or int_mm_fast():
        # On CPU, torch._int_mm takes any shape and strides (checked on torch 2.13, incl. M = 1, K = 7).
        acc = torch._int_mm(a, w.t())
    else:
        # Without AVX-512 VNNI / AMX, _int_mm has no fast CPU kernel (far slower than a float32 GEMM
        # on an AVX2-only CPU): the same integer products as a float32 GEMM, exact
        # while every partial sum stays below 2**24 in magnitude.
        acc = a.float() @ w.float().t()
    return int8_epilogue(acc, a_scale, w_scale, bias, out_dtype)


def int8_epilogue(
    acc: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """acc [M, N] (int32, or float32 holding integers) * a_scale[:, None] * w_scale[None, :] + bias."""
    # In float32, two passes over [M, N]: int32 * float32 promotes into the one output buffer,
    # then the per-channel scale (and the bias, fused by addcmul) in place.
    out = torch.mul(acc, a_scale.view(-1, 1))
    if bias is None:
        out.mul_(w_scale.view(1, -1))
    else:
        torch.addcmul(bias.view(1, -1).to(torch.float32), out, w_scale.view(1, -1), out=out)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def _check(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
           bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:  # fmt: skip
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise TesselError(f"int8_gemm wants a [M, K] and w [N, K]; got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.dtype != torch.int8 or w.dtype != torch.int8:
        raise TesselError(f"int8_gemm wants int8 a and w; got {a.dtype} and {w.dtype}")
    if a_scale.shape != (a.shape[0],) or w_scale.shape != (w.shape[0],):
        raise TesselError(
            f"int8_gemm wants a_scale [{a.shape[0]}] and w_scale [{w.shape[0]}]; "
            f"got {tuple(a_scale.shape)} and {tuple(w_scale.shape)}"
        )
    if a_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise TesselError(f"int8_gemm wants float32 scales; got {a_scale.dtype} and {w_scale.dtype}")
    if bias is not None and bias.shape != (w.shape[0],):
        raise TesselError(f"int8_gemm wants bias [{w.shape[0]}]; got {tuple(bias.shape)}")
    if out_dtype not in OUT_DTYPES:
        raise TesselError(f"int8_gemm out_dtype must be one of {OUT_DTYPES}; got {out_dtype}")


def int8_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """(a @ w.T) * a_scale[:, None] * w_scale[None, :] + bias, accumulated in int32.

    a: int8 [M, K]; w: int8 [N, K]; a_scale: float32 [M]; w_scale: float32 [N]; bias: [N] or None.
    Returns `out_dtype` [M, N] (float16, bfloat16 or float32).
    """
    _check(a, w, a_scale, w_scale, bias, out_dtype)
    if a.numel() == 0 or w.numel() == 0:  # an empty sum: only the bias is left
        out = torch.zeros((a.shape[0], w.shape[0]), dtype=out_dtype, device=a.device)
        return out if bias is None else out.add_(bias.to(out_dtype))
    if use_triton(a, w, a_scale, w_scale):
        dot = "int8" if int8_tensor_cores(a.device) else "int8_as_fp16"
        out_name = str(out_dtype).removeprefix("torch.")
        key = shape_key(
            m=bucket_m(a.shape[0]), n=w.shape[0], k=a.shape[1], out=out_name, bias=bias is not None
        )
        return gemm_triton(a, w, a_scale, w_scale, bias, out_dtype, dot, _TUNER, key)
    return _int8_gemm_torch(a, w, a_scale, w_scale, bias, out_dtype)
