"""RMSNorm, optionally with the residual add fused in (HF Llama convention).

    s   = x + residual                       (rounded to x.dtype: the new residual stream)
    out = (s * rsqrt(mean(s^2) + eps)).to(x.dtype) * weight

Statistics are computed in fp32 and the normalised row is cast back to `x.dtype` before the
weight multiply, as `LlamaRMSNorm` does; the result is returned in `x.dtype`. The Triton
kernel is forward-only (inference); a call that needs a gradient takes the PyTorch path.
"""

from __future__ import annotations

import torch

from tessel.kernels._utils import (
    as_rows,
    empty_rows_like,
    last_dim_contiguous,
    program_row,
    row_meta,
    row_operands,
    tl,
    triton,
)
from tessel.kernels.dispatch import use_triton

if triton is not None:

    @triton.jit
    def _load_residual_sum(x_row, r_row, s_row, offs, mask, HAS_RESIDUAL: tl.constexpr):
        """x at `offs`, plus the residual when there is one (rounded to x's dtype and stored as the
        new residual stream)."""
        x = tl.load(x_row + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_row + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(s_row + offs, x, mask=mask)
        return x

    @triton.jit
    def _store_normalised(x, rstd, W_ptr, y_row, offs, mask):
        """y = (x * rstd), rounded to x's dtype, times the weight, stored at `offs`."""
        w = tl.load(W_ptr + offs, mask=mask, other=0.0)
        y = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
        tl.store(y_row + offs, y.to(y_row.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_forward_kernel(
        X_ptr,
        X_row_stride,
        R_ptr,
        R_row_stride,
        W_ptr,
        Y_ptr,
        Y_row_stride,
        S_ptr,
        S_row_stride,
        n_cols,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SINGLE_BLOCK: tl.constexpr,
    ):
        x_row = program_row(X_ptr, X_row_stride)
        r_row = program_row(R_ptr, R_row_stride)
        y_row = program_row(Y_ptr, Y_row_stride)
        s_row = program_row(S_ptr, S_row_stride)
        cols = tl.arange(0, BLOCK_SIZE)

        if SINGLE_BLOCK:
            mask = cols < n_cols
            x = _load_residual_sum(x_row, r_row, s_row, cols, mask, HAS_RESIDUAL)
            xf = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
            _store_normalised(x, rstd, W_ptr, y_row, cols, mask)
        else:
            acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_SIZE):
                offs = start + cols
                mask = offs < n_cols
                xf = _load_residual_sum(x_row, r_row, s_row, offs, mask, HAS_RESIDUAL).to(tl.float32)
                acc += xf * xf
            rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
            for start in range(0, n_cols, BLOCK_SIZE):
                offs = start + cols
                mask = offs < n_cols
                if HAS_RESIDUAL:
                    x = tl.load(s_row + offs, mask=mask, other=0.0)
                else:
                    x = tl.load(x_row + offs, mask=mask, other=0.0)
                _store_normalised(x, rstd, W_ptr, y_row, offs, mask)


def _rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n_cols = x.shape[-1]
    x2 = as_rows(x)
    out, y2 = empty_rows_like(x)
    if residual is not None:
        r2 = as_rows(residual)
        new_residual, s2 = empty_rows_like(x)
    else:
        r2 = s2 = x2
        new_residual = None
    weight = last_dim_contiguous(weight)
    n_rows = x2.shape[0]
    if n_rows > 0:
        _rms_norm_forward_kernel[(n_rows,)](
            *row_operands(x2, r2),
            weight,
            *row_operands(y2, s2),
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            **row_meta(n_cols, x.element_size()),
        )
    return out, new_residual


def _rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    new_residual = None
    if residual is not None:
        x = x + residual
        new_residual = x
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # torch's fused kernel: one op instead of six, bit-equal to the lines below in float32
        # (checked on 1-64 rows x 17-4096 columns; tests/kernels/test_rms_norm.py holds it to them)
        return torch.rms_norm(x, (x.shape[-1],), weight, eps), new_residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * weight).to(x.dtype), new_residual


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim: `(x * rsqrt(mean(x^2) + eps)).to(x.dtype) * weight`.

    With `residual`, normalises `s = x + residual` and returns `(out, s)` (s is the new residual
    stream, in `x.dtype`); without, returns `out`. x: [..., H], weight: [H].
    """
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, residual)
    )
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if not needs_grad and x.numel() > 0 and use_triton(*tensors):
        out, new_residual = _rms_norm_triton(x, weight, eps, residual)
    else:
        out, new_residual = _rms_norm_torch(x, weight, eps, residual)
    return out if residual is None else (out, new_residual)
