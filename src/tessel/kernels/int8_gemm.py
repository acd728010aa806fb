"""W8A8 GEMM: int8 activations x int8 weights, int32 accumulation, scales fused in the epilogue.

    out[m, n] = (sum_k a[m, k] * w[n, k]) * a_scale[m] * w_scale[n] + bias[n]

`a` holds per-token quantised activations (`quantize_per_token`), `w` per-output-channel quantised
weights in nn.Linear's [N, K] layout. The integer dot product is exact (int32); the float epilogue
runs in float32 and rounds once to `out_dtype`.
"""

from __future__ import annotations

import torch

from tessel.errors import TesselError
from tessel.kernels import _output
from tessel.kernels._dispatch import use_triton
from tessel.kernels.autotune import (
    INT8_GEMM_CONFIGS,
    INTERPRETER_CONFIG,
    Autotuner,
    TileConfig,
    bucket_m,
    launch_tuned,
    shape_key,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch path still works
    triton = None

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


if triton is not None:

    @triton.jit
    def _int8_gemm_kernel(
        A_ptr,
        W_ptr,
        C_ptr,
        A_scale_ptr,
        W_scale_ptr,
        Bias_ptr,
        M,
        N,
        K,
        a_row_stride,
        a_col_stride,
        w_row_stride,
        w_col_stride,
        c_row_stride,
        c_col_stride,
        HAS_BIAS: tl.constexpr,
        INT8_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        # Grouped tile order: GROUP_M row tiles share the weight tiles they read while in L2.
        pid = tl.program_id(0).to(tl.int64)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pids_per_group = GROUP_M * num_pid_n
        first_pid_m = (pid // pids_per_group) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + (pid % pids_per_group) % group_rows
        pid_n = (pid % pids_per_group) // group_rows

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Wrap out-of-range rows/cols onto valid ones so the loads need no M/N mask; the store masks.
        rows_in = rows % M
        cols_in = cols % N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = A_ptr + rows_in[:, None] * a_row_stride + ks[None, :] * a_col_stride
        w_ptrs = W_ptr + cols_in[None, :] * w_row_stride + ks[:, None] * w_col_stride

        if INT8_DOT:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0)
            w = tl.load(w_ptrs, mask=ks[:, None] < k_left, other=0)
            if INT8_DOT:
                acc = tl.dot(a, w, acc, out_dtype=tl.int32)
            else:  # before sm_80: int8 -> fp16 is exact, products accumulate in fp32
                acc = tl.dot(a.to(tl.float16), w.to(tl.float16), acc)
            a_ptrs += BLOCK_K * a_col_stride
            w_ptrs += BLOCK_K * w_col_stride

        a_scale = tl.load(A_scale_ptr + rows_in)
        w_scale = tl.load(W_scale_ptr + cols_in)
        out = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
        if HAS_BIAS:
            out += tl.load(Bias_ptr + cols_in).to(tl.float32)[None, :]
        c_ptrs = C_ptr + rows[:, None] * c_row_stride + cols[None, :] * c_col_stride
        tl.store(c_ptrs, out.to(C_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def int8_tensor_cores(device: torch.device) -> bool:
    """Whether Triton's int8 tl.dot compiles here: sm_80+ (A100, L4, H100) yes; sm_70/sm_75 (V100,
    T4) no (Triton 3.9 fails in TritonGPUAccelerateMatmul), so there the kernel multiplies the int8
    tiles as fp16 (exact values) with fp32 accumulation: exact while |sum| < 2**24, else ~1e-7 relative.
    The interpreter (CPU tensors) runs the int8 dot."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 8


_TUNER = Autotuner("int8_gemm", INT8_GEMM_CONFIGS, default=INTERPRETER_CONFIG)


def _int8_gemm_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    M, K = a.shape
    N = w.shape[0]
    out = _output.empty_output((M, N), out_dtype, a.device)
    a_scale = a_scale.contiguous()
    w_scale = w_scale.contiguous()
    bias_arg = bias.contiguous() if bias is not None else w_scale  # never read when HAS_BIAS=False
    int8_dot = int8_tensor_cores(a.device)

    def launch(config: TileConfig) -> None:
        grid = (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n),)
        _int8_gemm_kernel[grid](
            a, w, out, a_scale, w_scale, bias_arg, M, N, K,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
            HAS_BIAS=bias is not None,
            INT8_DOT=int8_dot,
            **config.meta(),
        )  # fmt: skip

    key = shape_key(m=bucket_m(M), n=N, k=K, out=str(out_dtype).removeprefix("torch."), bias=bias is not None)
    launch_tuned(_TUNER, key, a, launch)
    return out


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
    else:
        # On CPU, torch._int_mm takes any shape and strides (checked on torch 2.13, incl. M = 1, K = 7).
        acc = torch._int_mm(a, w.t())
    # Epilogue in float32, two passes over [M, N]: int32 * float32 promotes into the one output
    # buffer, then the per-channel scale (and the bias, fused by addcmul) in place.
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
        return _int8_gemm_triton(a, w, a_scale, w_scale, bias, out_dtype)
    return _int8_gemm_torch(a, w, a_scale, w_scale, bias, out_dtype)
