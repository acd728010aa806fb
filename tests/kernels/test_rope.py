"""rope against HF Llama's `apply_rotary_pos_emb` math in float64, on both paths."""

from __future__ import annotations

import pytest
import torch

from tessel.kernels import rope

# (dtype, atol, rtol): rotation in fp32, one rounding to dtype, |values| up to ~5.
TOLERANCES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 4e-3, 2e-3),
    (torch.bfloat16, 4e-2, 1.6e-2),
]
# (tokens, q heads, kv heads, head dim)
SHAPES = [(1, 1, 1, 16), (7, 4, 2, 64), (5, 6, 1, 80), (3, 32, 8, 128)]


def cos_sin_table(max_pos: int, rot_dim: int, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return freqs.cos().float(), freqs.sin().float()


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_reference(q, k, positions, cos, sin):
    """transformers' apply_rotary_pos_emb in float64 (cos/sin duplicated to the rotary dim),
    with partial rotary: the columns past the rotary dim pass through."""
    rot = 2 * cos.shape[-1]
    c = torch.cat((cos, cos), dim=-1).double()[positions].unsqueeze(1)
    s = torch.cat((sin, sin), dim=-1).double()[positions].unsqueeze(1)

    def apply(x):
        x = x.double()
        xr, rest = x[..., :rot], x[..., rot:]
        return torch.cat((xr * c + rotate_half(xr) * s, rest), dim=-1)

    return apply(q), apply(k)


def _check(q, k, positions, cos, sin, atol, rtol):
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = rope(q, k, positions, cos, sin)
    ref_q, ref_k = hf_reference(q, k, positions, cos, sin)
    assert q_out.dtype == q.dtype and k_out.dtype == k.dtype
    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out.double(), ref_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_out.double(), ref_k, atol=atol, rtol=rtol)
    assert torch.equal(q, q_in) and torch.equal(k, k_in)  # new tensors, inputs untouched


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
def test_rope_matches_hf(backend, shape, dtype, atol, rtol):
    n_tokens, n_q, n_kv, head_dim = shape
    q = torch.randn(n_tokens, n_q, head_dim).to(dtype)
    k = torch.randn(n_tokens, n_kv, head_dim).to(dtype)
    positions = torch.randint(0, 300, (n_tokens,))
    cos, sin = cos_sin_table(300, head_dim)
    _check(q, k, positions, cos, sin, atol, rtol)


def test_rope_views_of_a_fused_qkv_and_int32_positions(backend):
    """q and k as column slices of one qkv projection output (token stride != heads * D)."""
    n_tokens, n_q, n_kv, head_dim = 9, 4, 2, 32
    qkv = torch.randn(n_tokens, (n_q + 2 * n_kv) * head_dim)
    q = qkv[:, : n_q * head_dim].view(n_tokens, n_q, head_dim)
    k = qkv[:, n_q * head_dim : (n_q + n_kv) * head_dim].view(n_tokens, n_kv, head_dim)
    positions = torch.arange(20, 20 + n_tokens, dtype=torch.int32)
    cos, sin = cos_sin_table(64, head_dim)
    _check(q, k, positions, cos, sin, 1e-5, 1e-5)


def test_rope_partial_rotary_dim(backend):
    """cos/sin narrower than D/2: only the first 2 * cos.shape[-1] columns rotate."""
    q, k = torch.randn(5, 3, 64), torch.randn(5, 1, 64)
    positions = torch.tensor([0, 1, 2, 17, 40])
    cos, sin = cos_sin_table(50, 24)
    _check(q, k, positions, cos, sin, 1e-5, 1e-5)


def test_bad_shapes_are_rejected():
    cos, sin = cos_sin_table(8, 16)
    with pytest.raises(ValueError):
        rope(torch.randn(2, 3, 16), torch.randn(3, 1, 16), torch.zeros(2, dtype=torch.long), cos, sin)
    with pytest.raises(ValueError):
        rope(torch.randn(2, 3, 8), torch.randn(2, 1, 8), torch.zeros(2, dtype=torch.long), cos, sin)


def test_no_tokens(backend):
    cos, sin = cos_sin_table(8, 16)
    q_out, k_out = rope(
        torch.randn(0, 2, 16), torch.randn(0, 1, 16), torch.zeros(0, dtype=torch.long), cos, sin
    )
    assert q_out.shape == (0, 2, 16) and k_out.shape == (0, 1, 16)
