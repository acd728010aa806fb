"""Rotary position embedding, rotate-half convention (HF Llama `apply_rotary_pos_emb`).

For a head vector x with halves x1 = x[:R/2], x2 = x[R/2:R] (R = 2 * cos.shape[-1], the rotary
dim, normally R = D) and c = cos[pos], s = sin[pos]:

    out[:R/2]  = x1 * c - x2 * s
    out[R/2:R] = x2 * c + x1 * s
    out[R:]    = x[R:]                 (partial rotary: the rest passes through)

which is `x * cat(c, c) + rotate_half(x) * cat(s, s)`. Computed in fp32, returned in x.dtype as
new tensors. The Triton kernel is forward-only; a call that needs a gradient takes the PyTorch
path.
"""

from __future__ import annotations

import torch

from tessel.kernels import _utils
from tessel.kernels._utils import last_dim_contiguous, tl, triton
from tessel.kernels.dispatch import use_triton

if triton is not None:

    @triton.jit
    def _rope_rotate_heads(
        X_ptr,
        x_tok_stride,
        x_head_stride,
        Y_ptr,
        y_tok_stride,
        y_head_stride,
        tok,
        c,
        s,
        n_heads,
        half,
        head_dim,
        BLOCK_H: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_PASS: tl.constexpr,
        HAS_PASS: tl.constexpr,
    ):
        heads = tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_HALF)
        mask = (heads[:, None] < n_heads) & (cols[None, :] < half)
        x_base = X_ptr + tok * x_tok_stride + heads[:, None] * x_head_stride
        y_base = Y_ptr + tok * y_tok_stride + heads[:, None] * y_head_stride
        x1 = tl.load(x_base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_base + half + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y1 = x1 * c[None, :] - x2 * s[None, :]
        y2 = x2 * c[None, :] + x1 * s[None, :]
        tl.store(y_base + cols[None, :], y1.to(Y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_base + half + cols[None, :], y2.to(Y_ptr.dtype.element_ty), mask=mask)
        if HAS_PASS:
            rest = 2 * half + tl.arange(0, BLOCK_PASS)
            pmask = (heads[:, None] < n_heads) & (rest[None, :] < head_dim)
            xp = tl.load(x_base + rest[None, :], mask=pmask, other=0.0)
            tl.store(y_base + rest[None, :], xp, mask=pmask)

    @triton.jit
    def _rope_kernel(
        Q_ptr,
        q_tok_stride,
        q_head_stride,
        K_ptr,
        k_tok_stride,
        k_head_stride,
        QO_ptr,
        qo_tok_stride,
        qo_head_stride,
        KO_ptr,
        ko_tok_stride,
        ko_head_stride,
        Pos_ptr,
        Cos_ptr,
        cos_row_stride,
        Sin_ptr,
        sin_row_stride,
        n_q_heads,
        n_k_heads,
        half,
        head_dim,
        BLOCK_HQ: tl.constexpr,
        BLOCK_HK: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_PASS: tl.constexpr,
        HAS_PASS: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(Pos_ptr + tok).to(tl.int64)
        cols = tl.arange(0, BLOCK_HALF)
        cmask = cols < half
        c = tl.load(Cos_ptr + pos * cos_row_stride + cols, mask=cmask, other=0.0).to(tl.float32)
        s = tl.load(Sin_ptr + pos * sin_row_stride + cols, mask=cmask, other=0.0).to(tl.float32)
        _rope_rotate_heads(
            Q_ptr, q_tok_stride, q_head_stride, QO_ptr, qo_tok_stride, qo_head_stride,
            tok, c, s, n_q_heads, half, head_dim, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS, HAS_PASS,
        )  # fmt: skip
        _rope_rotate_heads(
            K_ptr, k_tok_stride, k_head_stride, KO_ptr, ko_tok_stride, ko_head_stride,
            tok, c, s, n_k_heads, half, head_dim, BLOCK_HK, BLOCK_HALF, BLOCK_PASS, HAS_PASS,
        )  # fmt: skip


def _rope_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    n_tokens, n_q_heads, head_dim = q.shape
    n_k_heads = k.shape[1]
    half = cos.shape[-1]
    q, k, cos, sin = (last_dim_contiguous(t) for t in (q, k, cos, sin))
    positions = positions.contiguous()
    q_out = _utils.empty_output(q.shape, q.dtype, q.device)
    k_out = _utils.empty_output(k.shape, k.dtype, k.device)
    n_pass = head_dim - 2 * half
    if n_tokens > 0:
        _rope_kernel[(n_tokens,)](
            q, q.stride(0), q.stride(1),
            k, k.stride(0), k.stride(1),
            q_out, q_out.stride(0), q_out.stride(1),
            k_out, k_out.stride(0), k_out.stride(1),
            positions, cos, cos.stride(0), sin, sin.stride(0),
            n_q_heads, n_k_heads, half, head_dim,
            BLOCK_HQ=triton.next_power_of_2(n_q_heads),
            BLOCK_HK=triton.next_power_of_2(n_k_heads),
            BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_PASS=triton.next_power_of_2(max(n_pass, 1)),
            HAS_PASS=n_pass > 0,
        )  # fmt: skip
    return q_out, k_out


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    half = c.shape[-1]
    xf = x.float() if x.dtype != torch.float64 else x
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)
    return rotated.to(x.dtype)


def rope_tables(
    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cat(c, c), cat(-s, s)) [T, 1, R] for the PyTorch path, c = cos[pos], s = sin[pos] in the
    compute dtype (float64 for float64 q, else float32). The same for every layer of a step, so the
    model's rotary module computes them once per step and passes them to `rope(tables=...)`."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    c = cos[positions].to(compute).unsqueeze(1)
    s = sin[positions].to(compute).unsqueeze(1)
    return torch.cat((c, c), dim=-1), torch.cat((s.neg(), s), dim=-1)


def _rotate_with_tables(x: torch.Tensor, c2: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    # [x1 | x2] * [c | c] + [x2 | x1] * [-s | s] = [x1 c - x2 s | x2 c + x1 s]: the same products and
    # the same sums as `_rotate` (a - b == a + (-b) exactly), in four ops instead of eight.
    half = c2.shape[-1] // 2
    if 2 * half != x.shape[-1]:  # partial rotary: the columns past R pass through
        return _rotate(x, c2[..., :half], -s2[..., :half])
    xf = x.float() if x.dtype != torch.float64 else x
    swapped = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
    out = xf * c2
    out += swapped * s2
    return out.to(x.dtype)


def rope_rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, H, D] rotated with `rope_tables(positions, cos, sin, x.dtype)` on the PyTorch path: any
    heads at once (q and k side by side), exactly as `rope` rotates each."""
    return _rotate_with_tables(x, *tables)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE: `x * cat(c, c) + rotate_half(x) * cat(s, s)`, c = cos[pos], s = sin[pos].

    q: [T, Hq, D], k: [T, Hkv, D], positions: int [T], cos/sin: [max_pos, R/2] with R <= D the
    rotary dim (columns past R pass through). Returns new (q, k) in their dtypes.
    `tables`: `rope_tables(positions, cos, sin, q.dtype)` when the caller already has them (the
    PyTorch path then skips the gather; the Triton path does not use them).
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"rope expects q [T, Hq, D] and k [T, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if cos.shape != sin.shape or 2 * cos.shape[-1] > q.shape[-1]:
        raise ValueError(f"rope expects cos/sin [max_pos, R/2] with R <= D, got {tuple(cos.shape)}")
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if not needs_grad and q.shape[0] > 0 and use_triton(q, k, positions, cos, sin):
        return _rope_triton(q, k, positions, cos, sin)
    if tables is None:
        tables = rope_tables(positions, cos, sin, q.dtype)
    return rope_rotate(q, tables), rope_rotate(k, tables)
