"""W8A16 GEMM: float activations x int8 weights dequantised inside the kernel.

    out[m, n] = sum_k x[m, k] * (w[n, k] * w_scale[n]) + bias[n]
              = (sum_k x[m, k] * w[n, k]) * w_scale[n] + bias[n]

Each int8 weight tile is converted to the activation dtype in registers (exact: |w| <= 127 fits
float16 and bfloat16), multiplied on the tensor cores with float32 accumulation, and the
per-channel scale is applied once per output in the epilogue. Weights cross memory as int8:
half the bytes of an fp16 GEMM, which is what decode (small M, memory-bound) pays for.

Triton 3.9's interpreter multiplies bfloat16 tiles as their raw 16-bit patterns (np.matmul on
uint16), so under TRITON_INTERPRET=1 a bfloat16 dot runs in float32 instead (`DOT_IN_FP32`);
compiled kernels use the native bfloat16 dot.

The same kernel with float weights and no scale (`HAS_SCALE=False`) is `linear`, the GEMM
behind `tessel.layers.Linear`.
"""

from __future__ import annotations

import torch

from tessel.errors import TesselError
from tessel.kernels import _output
from tessel.kernels._dispatch import interpreting, use_triton
from tessel.kernels.autotune import (
    FLOAT_GEMM_CONFIGS,
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

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


if triton is not None:

    @triton.jit
    def _mixed_gemm_kernel(
        X_ptr,
        W_ptr,
        Out_ptr,
        W_scale_ptr,
        Bias_ptr,
        M,
        N,
        K,
        x_row_stride,
        x_col_stride,
        w_row_stride,
        w_col_stride,
        out_row_stride,
        out_col_stride,
        HAS_SCALE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        IEEE_FP32: tl.constexpr,
        DOT_IN_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
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
        rows_in = rows % M
        cols_in = cols % N
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = X_ptr + rows_in[:, None] * x_row_stride + ks[None, :] * x_col_stride
        w_ptrs = W_ptr + cols_in[None, :] * w_row_stride + ks[:, None] * w_col_stride

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=ks[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=ks[:, None] < k_left, other=0)
            if DOT_IN_FP32:
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            elif IEEE_FP32:
                acc = tl.dot(x, w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w.to(x.dtype), acc)  # int8 -> fp16/bf16 is exact for |w| <= 127
            x_ptrs += BLOCK_K * x_col_stride
            w_ptrs += BLOCK_K * w_col_stride

        if HAS_SCALE:
            acc = acc * tl.load(W_scale_ptr + cols_in).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(Bias_ptr + cols_in).to(tl.float32)[None, :]
        out_ptrs = Out_ptr + rows[:, None] * out_row_stride + cols[None, :] * out_col_stride
        tl.store(out_ptrs, acc.to(Out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


_TUNERS = {
    "w8a16_gemm": Autotuner("w8a16_gemm", FLOAT_GEMM_CONFIGS, default=INTERPRETER_CONFIG),
    "linear": Autotuner("linear", FLOAT_GEMM_CONFIGS, default=INTERPRETER_CONFIG),
}


def _mixed_gemm_triton(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    out = _output.empty_output((M, N), x.dtype, x.device)
    w_scale = w_scale.contiguous() if w_scale is not None else None
    bias = bias.contiguous() if bias is not None else None
    # Unused pointers (flag False) still need a tensor argument; they are never dereferenced.
    scale_arg = w_scale if w_scale is not None else out
    bias_arg = bias if bias is not None else out

    def launch(config: TileConfig) -> None:
        grid = (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n),)
        _mixed_gemm_kernel[grid](
            x, w, out, scale_arg, bias_arg, M, N, K,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
            HAS_SCALE=w_scale is not None,
            HAS_BIAS=bias is not None,
            IEEE_FP32=x.dtype == torch.float32,
            DOT_IN_FP32=x.dtype == torch.bfloat16 and interpreting(),
            **config.meta(),
        )  # fmt: skip

    name = "w8a16_gemm" if w_scale is not None else "linear"
    key = shape_key(m=bucket_m(M), n=N, k=K, x=str(x.dtype).removeprefix("torch."), bias=bias is not None)
    launch_tuned(_TUNERS[name], key, x, launch)
    return out


# Weight rows dequantised per step of the PyTorch path: 2**24 float32 elements (64 MiB) bound the
# transient float copy (a 28672 x 8192 weight would otherwise need 940 MiB per call) while keeping
# the number of separate ops small (on this loaded 2-core machine every extra parallel op risked a
# scheduler stall: 4 MiB blocks measured 2-10x slower than one block at 2 threads).
DEQUANT_CHUNK_ELEMENTS = 1 << 24


def _w8a16_gemm_torch(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # Dequantise a block of weight rows at a time and hand it to the library GEMM. On CPU this
    # saves memory, not time: torch's own int8-weight CPU kernel (torch._weight_int8pack_mm)
    # measured ~20x slower than fp32 F.linear at 256 x 4096 x 4096.
    n, k = w.shape
    rows = max(16, DEQUANT_CHUNK_ELEMENTS // max(k, 1))
    scale = w_scale.view(-1, 1).float()
    parts = []
    for start in range(0, n, rows):
        block = w[start : start + rows].float().mul_(scale[start : start + rows])
        parts.append(x @ block.to(x.dtype).t())
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out if bias is None else out.add_(bias.to(x.dtype))


def _check_x(name: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise TesselError(f"{name} wants x [M, K] and w [N, K]; got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in X_DTYPES:
        raise TesselError(f"{name} wants a float16/bfloat16/float32 x; got {x.dtype}")
    if bias is not None and bias.shape != (w.shape[0],):
        raise TesselError(f"{name} wants bias [{w.shape[0]}]; got {tuple(bias.shape)}")


def _empty_sum(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.zeros((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    return out if bias is None else out.add_(bias.to(x.dtype))


def w8a16_gemm(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ (w * w_scale[:, None]).T + bias, with the int8 weights dequantised inside the kernel.

    x: float16 / bfloat16 / float32 [M, K]; w: int8 [N, K]; w_scale: float [N]; bias: [N] or None.
    Returns x.dtype [M, N]; float32 accumulation.
    """
    _check_x("w8a16_gemm", x, w, bias)
    if w.dtype != torch.int8:
        raise TesselError(f"w8a16_gemm wants an int8 w; got {w.dtype}")
    if w_scale.shape != (w.shape[0],) or not w_scale.is_floating_point():
        raise TesselError(f"w8a16_gemm wants a float w_scale [{w.shape[0]}]; got {tuple(w_scale.shape)}")
    if x.numel() == 0 or w.numel() == 0:
        return _empty_sum(x, w, bias)
    if use_triton(x, w, w_scale):
        return _mixed_gemm_triton(x, w, w_scale, bias)
    return _w8a16_gemm_torch(x, w, w_scale, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias for float x [M, K] and weight [N, K] of the same dtype (nn.functional.linear)."""
    _check_x("linear", x, weight, bias)
    if weight.dtype != x.dtype:
        raise TesselError(f"linear wants weight in x's dtype {x.dtype}; got {weight.dtype}")
    if x.numel() == 0 or weight.numel() == 0:
        return _empty_sum(x, weight, bias)
    if use_triton(x, weight):
        return _mixed_gemm_triton(x, weight, None, bias)
    return torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))
