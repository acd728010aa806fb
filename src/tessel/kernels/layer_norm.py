"""LayerNorm over the last dim.

    mean = sum(x) / H,  var = sum((x - mean)^2) / H
    out  = (x - mean) * rsqrt(var + eps) * weight + bias

Computed in fp32, returned in `x.dtype` (as `torch.nn.functional.layer_norm` under autocast-free
fp16/bf16 does). `weight` and `bias` may be None. The Triton kernel is forward-only (inference);
a call that needs a gradient takes the PyTorch path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessel.kernels._utils import as_rows, empty_rows_like, program_row, row_meta, row_operands, tl, triton
from tessel.kernels.dispatch import use_triton

if triton is not None:

    @triton.jit
    def _layer_norm_forward_kernel(
        X_ptr,
        X_row_stride,
        W_ptr,
        B_ptr,
        Y_ptr,
        Y_row_stride,
        n_cols,
        eps,
        HAS_WEIGHT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SINGLE_BLOCK: tl.constexpr,
    ):
        x_row = program_row(X_ptr, X_row_stride)
        y_row = program_row(Y_ptr, Y_row_stride)
        cols = tl.arange(0, BLOCK_SIZE)

        if SINGLE_BLOCK:
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.sum(x, axis=0) / n_cols
            xc = tl.where(mask, x - mean, 0.0)
            rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
            y = xc * rstd
            if HAS_WEIGHT:
                y = y * tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y = y + tl.load(B_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + cols, y.to(Y_ptr.dtype.element_ty), mask=mask)
        else:
            # Two passes over the row: mean first, then the centred sum of squares (stable).
            acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_SIZE):
                offs = start + cols
                acc += tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
            mean = tl.sum(acc, axis=0) / n_cols
            acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_SIZE):
                offs = start + cols
                mask = offs < n_cols
                x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
                xc = tl.where(mask, x - mean, 0.0)
                acc += xc * xc
            rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
            for start in range(0, n_cols, BLOCK_SIZE):
                offs = start + cols
                mask = offs < n_cols
                x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
                y = (x - mean) * rstd
                if HAS_WEIGHT:
                    y = y * tl.load(W_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                if HAS_BIAS:
                    y = y + tl.load(B_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(y_row + offs, y.to(Y_ptr.dtype.element_ty), mask=mask)


def _layer_norm_triton(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    n_cols = x.shape[-1]
    x2 = as_rows(x)
    out, y2 = empty_rows_like(x)
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    if x2.shape[0] > 0:
        _layer_norm_forward_kernel[(x2.shape[0],)](
            *row_operands(x2),
            weight if weight is not None else x2,
            bias if bias is not None else x2,
            *row_operands(y2),
            n_cols,
            eps,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            **row_meta(n_cols, x.element_size()),
        )
    return out


def _layer_norm_torch(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    same = all(t is None or t.dtype == x.dtype for t in (weight, bias))
    if same:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """LayerNorm over the last dim: `(x - mean) * rsqrt(var + eps) * weight + bias` (biased var).

    x: [..., H]; weight, bias: [H] or None. Returned in `x.dtype`.
    """
    tensors = [t for t in (x, weight, bias) if t is not None]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not needs_grad and x.numel() > 0 and use_triton(*tensors):
        return _layer_norm_triton(x, weight, bias, eps)
    return _layer_norm_torch(x, weight, bias, eps)
