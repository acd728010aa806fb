"""Tiled 2-D transpose into a new contiguous tensor.

    out[j, i] = x[i, j]        x: [M, N] (any strides) -> out: [N, M] contiguous

Each program loads a BLOCK_M x BLOCK_N tile with reads along x's rows, transposes it in
registers/shared memory (`tl.trans`) and writes it along out's rows, so both the reads and the
writes are coalesced.
"""

from __future__ import annotations

import torch

from tessel.errors import TesselError
from tessel.kernels import _utils
from tessel.kernels._utils import tl, triton
from tessel.kernels.dispatch import use_triton

BLOCK = 64  # 64 x 64 tiles: 16 KiB of fp32 per tile, a common choice for transposes


if triton is not None:

    @triton.jit
    def _transpose_kernel(
        X_ptr,
        Out_ptr,
        M,
        N,
        x_row_stride,
        x_col_stride,
        out_row_stride,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid // num_pid_n
        pid_n = pid % num_pid_n
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tile = tl.load(X_ptr + rows[:, None] * x_row_stride + cols[None, :] * x_col_stride, mask=mask)
        out_ptrs = Out_ptr + cols[:, None] * out_row_stride + rows[None, :]
        out_mask = (cols[:, None] < N) & (rows[None, :] < M)
        tl.store(out_ptrs, tl.trans(tile), mask=out_mask)


def _transpose_triton(x: torch.Tensor) -> torch.Tensor:
    M, N = x.shape
    out = _utils.empty_output((N, M), x.dtype, x.device)
    grid = (triton.cdiv(M, BLOCK) * triton.cdiv(N, BLOCK),)
    _transpose_kernel[grid](
        x, out, M, N, x.stride(0), x.stride(1), out.stride(0), BLOCK_M=BLOCK, BLOCK_N=BLOCK, num_warps=4
    )
    return out


def transpose(x: torch.Tensor) -> torch.Tensor:
    """out[j, i] = x[i, j]: the [N, M] contiguous transpose of a 2-D tensor of any dtype and strides."""
    if x.dim() != 2:
        raise TesselError(f"transpose wants a 2-D tensor; got shape {tuple(x.shape)}")
    if x.numel() == 0:
        return x.t().contiguous()
    if use_triton(x):
        if x.dtype == torch.bool:  # moved as bytes
            return _transpose_triton(x.view(torch.uint8)).view(torch.bool)
        return _transpose_triton(x)
    return x.t().contiguous()
