"""Softmax (optionally masked) and log-softmax over the last dim, with Triton backward kernels.

    z = x                        (no mask)
    z = where(mask, x, -inf)     (boolean mask, True = keep)
    z = x + mask                 (additive float mask, e.g. 0 / -inf)
    softmax:      y_i = exp(z_i - max z) / sum_j exp(z_j - max z);   a fully masked row gives zeros
    log_softmax:  y_i = x_i - max x - log(sum_j exp(x_j - max x))

Backward (y = the saved output, g = upstream gradient):

    softmax:      dx = y * (g - sum_j g_j y_j)        (and d(additive mask) = dx, summed to its shape)
    log_softmax:  dx = g - exp(y) * sum_j g_j

The mask broadcasts against x. The Triton kernels compute in fp32 and return `x.dtype`;
rows of any length are handled in column tiles (two passes, online max and sum).
"""

from __future__ import annotations

import torch

from tessel.kernels._utils import as_rows, empty_rows_like, program_row, row_meta, row_operands, tl, triton
from tessel.kernels.dispatch import use_triton

MAX_FUSED_BYTES = 32768  # rows up to this many bytes stay in registers in one tile
MASK_NONE, MASK_BOOL, MASK_ADD = 0, 1, 2


if triton is not None:

    @triton.jit
    def _load_logits(X_ptr, x_row_stride, M_ptr, m_row_stride, row, offs, n_cols, MASK_KIND: tl.constexpr):
        valid = offs < n_cols
        z = tl.load(X_ptr + row * x_row_stride + offs, mask=valid, other=float("-inf")).to(tl.float32)
        if MASK_KIND == 1:
            keep = tl.load(M_ptr + row * m_row_stride + offs, mask=valid, other=0)
            z = tl.where(keep != 0, z, float("-inf"))
        if MASK_KIND == 2:
            z = z + tl.load(M_ptr + row * m_row_stride + offs, mask=valid, other=0.0).to(tl.float32)
        return z

    @triton.jit
    def _softmax_forward_kernel(
        X_ptr,
        x_row_stride,
        M_ptr,
        m_row_stride,
        Y_ptr,
        y_row_stride,
        n_cols,
        MASK_KIND: tl.constexpr,
        LOG: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SINGLE_BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_SIZE)
        y_row = program_row(Y_ptr, y_row_stride)
        if SINGLE_BLOCK:
            z = _load_logits(X_ptr, x_row_stride, M_ptr, m_row_stride, row, cols, n_cols, MASK_KIND)
            m = tl.max(z, axis=0)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            e = tl.exp(z - m_safe)
            d = tl.sum(e, axis=0)
            if LOG:
                y = z - m_safe - tl.log(d)
            else:
                y = e / tl.where(d == 0.0, 1.0, d)
            tl.store(y_row + cols, y.to(Y_ptr.dtype.element_ty), mask=cols < n_cols)
        else:
            # Pass 1: running max and rescaled running sum, elementwise per lane.
            m_vec = tl.full([BLOCK_SIZE], float("-inf"), dtype=tl.float32)
            d_vec = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_SIZE):
                z = _load_logits(
                    X_ptr, x_row_stride, M_ptr, m_row_stride, row, start + cols, n_cols, MASK_KIND
                )
                m_new = tl.maximum(m_vec, z)
                m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                d_vec = d_vec * tl.exp(m_vec - m_new_safe) + tl.exp(z - m_new_safe)
                m_vec = m_new
            m = tl.max(m_vec, axis=0)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            lane_safe = tl.where(m_vec == float("-inf"), 0.0, m_vec)
            d = tl.sum(d_vec * tl.exp(lane_safe - m_safe), axis=0)
            if LOG:
                log_d = tl.log(d)
            else:
                inv_d = 1.0 / tl.where(d == 0.0, 1.0, d)
            # Pass 2: normalise and write.
            for start in range(0, n_cols, BLOCK_SIZE):
                offs = start + cols
                z = _load_logits(X_ptr, x_row_stride, M_ptr, m_row_stride, row, offs, n_cols, MASK_KIND)
                if LOG:
                    y = z - m_safe - log_d
                else:
                    y = tl.exp(z - m_safe) * inv_d
                tl.store(y_row + offs, y.to(Y_ptr.dtype.element_ty), mask=offs < n_cols)

    @triton.jit
    def _softmax_backward_kernel(
        Y_ptr,
        y_row_stride,
        DY_ptr,
        dy_row_stride,
        DX_ptr,
        dx_row_stride,
        n_cols,
        LOG: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SINGLE_BLOCK: tl.constexpr,
    ):
        cols = tl.arange(0, BLOCK_SIZE)
        y_row = program_row(Y_ptr, y_row_stride)
        dy_row = program_row(DY_ptr, dy_row_stride)
        dx_row = program_row(DX_ptr, dx_row_stride)
        if SINGLE_BLOCK:
            mask = cols < n_cols
            dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
            if LOG:
                y = tl.load(y_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
                dx = dy - tl.exp(y) * tl.sum(dy, axis=0)
            else:
                y = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
                dx = y * (dy - tl.sum(dy * y, axis=0))
            tl.store(dx_row + cols, dx.to(DX_ptr.dtype.element_ty), mask=mask)
        else:
            acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_SIZE):
                offs = start + cols
                mask = offs < n_cols
                dy = tl.load(dy_row + offs, mask=mask, other=0.0).to(tl.float32)
                if LOG:
                    acc += dy
                else:
                    acc += dy * tl.load(y_row + offs, mask=mask, other=0.0).to(tl.float32)
            total = tl.sum(acc, axis=0)
            for start in range(0, n_cols, BLOCK_SIZE):
                offs = start + cols
                mask = offs < n_cols
                dy = tl.load(dy_row + offs, mask=mask, other=0.0).to(tl.float32)
                if LOG:
                    y = tl.load(y_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
                    dx = dy - tl.exp(y) * total
                else:
                    y = tl.load(y_row + offs, mask=mask, other=0.0).to(tl.float32)
                    dx = y * (dy - total)
                tl.store(dx_row + offs, dx.to(DX_ptr.dtype.element_ty), mask=mask)


def _mask_rows(mask: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    mask = mask.expand_as(x)
    if mask.dtype == torch.bool:
        return as_rows(mask.to(torch.uint8)), MASK_BOOL
    return as_rows(mask), MASK_ADD


def _forward_triton(x: torch.Tensor, mask: torch.Tensor | None, log: bool) -> torch.Tensor:
    n_cols = x.shape[-1]
    x2 = as_rows(x)
    if mask is None:
        m2, kind = x2, MASK_NONE
    else:
        m2, kind = _mask_rows(mask, x)
    y, y2 = empty_rows_like(x)
    if x2.shape[0] > 0 and n_cols > 0:
        _softmax_forward_kernel[(x2.shape[0],)](
            *row_operands(x2, m2, y2), n_cols, MASK_KIND=kind, LOG=log, **row_meta(n_cols, 4, MAX_FUSED_BYTES)
        )
    return y


def _backward_triton(y: torch.Tensor, dy: torch.Tensor, log: bool) -> torch.Tensor:
    n_cols = y.shape[-1]
    y2, dy2 = as_rows(y), as_rows(dy)
    dx, dx2 = empty_rows_like(y)
    if y2.shape[0] > 0 and n_cols > 0:
        _softmax_backward_kernel[(y2.shape[0],)](
            *row_operands(y2, dy2, dx2), n_cols, LOG=log, **row_meta(n_cols, 4, MAX_FUSED_BYTES)
        )
    return dx


class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        y = _forward_triton(x, mask, log=False)
        ctx.save_for_backward(y)
        ctx.mask_shape = None if mask is None else mask.shape
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        (y,) = ctx.saved_tensors
        dx = _backward_triton(y, dy, log=False)
        dmask = dx.sum_to_size(ctx.mask_shape) if ctx.needs_input_grad[1] else None
        return (dx if ctx.needs_input_grad[0] else None), dmask


class _LogSoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = _forward_triton(x, None, log=True)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return _backward_triton(y, dy, log=True)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _softmax_torch(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return torch.softmax(x, dim=-1, dtype=_compute_dtype(x.dtype)).to(x.dtype)
    z = x.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else x + mask
    dead = (z == float("-inf")).all(dim=-1, keepdim=True)
    # Fully masked rows: softmax of zeros (finite, no NaN in forward or backward), then zeroed.
    y = torch.softmax(z.masked_fill(dead, 0.0), dim=-1, dtype=_compute_dtype(x.dtype))
    return y.masked_fill(dead, 0.0).to(x.dtype)


def softmax(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim; `mask` (broadcastable to x) is boolean (True = keep) or an
    additive float mask (0 keep, -inf drop). Fully masked rows give zeros. Differentiable."""
    if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(f"softmax mask must be bool (True = keep) or float (additive), got {mask.dtype}")
    tensors = (x,) if mask is None else (x, mask)
    if x.numel() > 0 and use_triton(*tensors):
        return _SoftmaxFunction.apply(x, mask)
    return _softmax_torch(x, mask)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim: `x - max(x) - log(sum(exp(x - max(x))))`. Differentiable."""
    if x.numel() > 0 and use_triton(x):
        return _LogSoftmaxFunction.apply(x)
    return torch.log_softmax(x, dim=-1, dtype=_compute_dtype(x.dtype)).to(x.dtype)
