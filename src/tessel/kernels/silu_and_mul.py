"""SiLU-and-mul, the gate of a SwiGLU MLP.

    x = [a | b]  (last dim 2F)
    out = silu(a) * b = a / (1 + exp(-a)) * b

The Triton kernel computes in fp32 and rounds once to `x.dtype`. It is forward-only
(inference); a call that needs a gradient takes the PyTorch path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessel.kernels import _utils
from tessel.kernels._utils import as_rows, tl, triton
from tessel.kernels.dispatch import use_triton

BLOCK_COLS = 1024  # columns of the output row per program


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(
        X_ptr,
        X_row_stride,
        Y_ptr,
        Y_row_stride,
        n_cols,
        BLOCK_SIZE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        col_block = tl.program_id(1).to(tl.int64)
        offs = col_block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offs < n_cols
        x_row = X_ptr + row * X_row_stride
        a = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_row + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        y = a * tl.sigmoid(a) * b
        tl.store(Y_ptr + row * Y_row_stride + offs, y.to(Y_ptr.dtype.element_ty), mask=mask)


def _silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    n_cols = x.shape[-1] // 2
    x2 = as_rows(x)
    out = _utils.empty_output((*x.shape[:-1], n_cols), x.dtype, x.device)
    y2 = out.view(-1, n_cols)
    block = min(BLOCK_COLS, triton.next_power_of_2(max(n_cols, 1)))
    if x2.shape[0] > 0 and n_cols > 0:
        grid = (x2.shape[0], triton.cdiv(n_cols, block))
        _silu_and_mul_kernel[grid](x2, x2.stride(0), y2, y2.stride(0), n_cols, BLOCK_SIZE=block)
    return out


def _silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2F] -> silu(x[..., :F]) * x[..., F:], shape [..., F], in `x.dtype`."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    needs_grad = torch.is_grad_enabled() and x.requires_grad
    if not needs_grad and x.numel() > 0 and use_triton(x):
        return _silu_and_mul_triton(x)
    return _silu_and_mul_torch(x)
