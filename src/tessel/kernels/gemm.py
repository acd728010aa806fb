"""Tiled GEMM with a fused epilogue: the one Triton kernel behind `int8_gemm` (W8A8),
`w8a16_gemm` and `linear`.

    out[m, n] = (sum_k a[m, k] * w[n, k]) * a_scale[m] * w_scale[n] + bias[n]

`a` [M, K] is int8 with a per-row scale or float without one; `w` [N, K] (nn.Linear's layout) is
int8 with a per-output-channel scale or float without one. Tiles are multiplied as the `DOT` mode
says (`_utils.dot_acc`: an exact int32 dot for int8 x int8, int8 weights converted to the
activation dtype in registers, fp32 for fp32), the scales and the bias are applied once per output
in the float32 epilogue, and the result is rounded once to the output dtype.
"""

from __future__ import annotations

import torch

from tessel.kernels import _utils
from tessel.kernels._utils import dot_acc, grouped_tile, tl, triton
from tessel.kernels.autotune import Autotuner, TileConfig, launch_tuned

if triton is not None:
    # M (the rows: a step's tokens) is not specialised on: Triton would otherwise compile each tile
    # again for M == 1 and for M a multiple of 16, so a step whose row count is new to the process
    # would wait for compiles; the kernel reads M only in `rows % M`, the grid and the store mask.
    @triton.jit(do_not_specialize=["M"])
    def _gemm_kernel(
        A_ptr, W_ptr, Out_ptr, A_scale_ptr, W_scale_ptr, Bias_ptr,
        M, N, K,
        a_row_stride, a_col_stride, w_row_stride, w_col_stride, out_row_stride, out_col_stride,
        HAS_A_SCALE: tl.constexpr,
        HAS_W_SCALE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        DOT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):  # fmt: skip
        rows, cols = grouped_tile(tl.program_id(0).to(tl.int64), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        # Wrap out-of-range rows/cols onto valid ones so the loads need no M/N mask; the store masks.
        rows_in = rows % M
        cols_in = cols % N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = A_ptr + rows_in[:, None] * a_row_stride + ks[None, :] * a_col_stride
        w_ptrs = W_ptr + cols_in[None, :] * w_row_stride + ks[:, None] * w_col_stride

        if DOT == "int8":
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0)
            w = tl.load(w_ptrs, mask=ks[:, None] < k_left, other=0)
            acc = dot_acc(a, w, acc, DOT)
            a_ptrs += BLOCK_K * a_col_stride
            w_ptrs += BLOCK_K * w_col_stride

        out = acc.to(tl.float32)
        if HAS_A_SCALE:
            out = out * tl.load(A_scale_ptr + rows_in).to(tl.float32)[:, None]
        if HAS_W_SCALE:
            out = out * tl.load(W_scale_ptr + cols_in).to(tl.float32)[None, :]
        if HAS_BIAS:
            out += tl.load(Bias_ptr + cols_in).to(tl.float32)[None, :]
        out_ptrs = Out_ptr + rows[:, None] * out_row_stride + cols[None, :] * out_col_stride
        tl.store(out_ptrs, out.to(Out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def gemm_triton(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor | None,
    w_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    dot: str,
    tuner: Autotuner,
    key: str,
) -> torch.Tensor:
    """Launch `_gemm_kernel` on a [M, K] and w [N, K] (any strides) with the tile `tuner` picks for `key`."""
    M, K = a.shape
    N = w.shape[0]
    out = _utils.empty_output((M, N), out_dtype, a.device)
    a_scale, w_scale, bias = (t.contiguous() if t is not None else None for t in (a_scale, w_scale, bias))

    def pointer(t: torch.Tensor | None) -> torch.Tensor:
        return t if t is not None else out  # the pointer of a False flag is never dereferenced

    def launch(config: TileConfig) -> None:
        grid = (triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n),)
        _gemm_kernel[grid](
            a, w, out, pointer(a_scale), pointer(w_scale), pointer(bias), M, N, K,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
            HAS_A_SCALE=a_scale is not None,
            HAS_W_SCALE=w_scale is not None,
            HAS_BIAS=bias is not None,
            DOT=dot,
            **config.meta(),
        )  # fmt: skip

    launch_tuned(tuner, key, a, launch)
    return out
