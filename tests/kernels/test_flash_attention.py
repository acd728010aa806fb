"""flash_attention (and its int8-QK variant) against float64 SDPA, on both paths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tessel.kernels import flash_attention, flash_attention_int8
from tessel.kernels.flash_attention import quantize_rows_int8

# (dtype, atol, rtol) against float64 SDPA on the same (rounded) inputs. fp32: exact fp32 dots.
# fp16/bf16: P is rounded to the input dtype for P @ V (tensor-core input) and O once at the end,
# so about two ulps of the dtype on outputs of size <= 1.
TOLERANCES = [
    (torch.float32, 2e-5, 1e-4),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 2e-2, 1.6e-2),
]
# (batch, q heads, kv heads, Sq, Sk, D): decode (Sq = 1), chunk after a prefix (Sq < Sk),
# plain prefill (Sq = Sk), Sk not a multiple of the 64 key block, non-power-of-2 D (80, 96).
CASES = [
    (1, 1, 1, 1, 1, 16),
    (2, 4, 2, 1, 37, 64),
    (1, 4, 4, 17, 17, 80),
    (2, 6, 2, 13, 50, 96),
    (1, 2, 1, 40, 100, 32),
    (1, 4, 2, 70, 70, 128),
    (1, 3, 1, 5, 130, 64),
]


@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs the op allocates start as NaN, so an element the kernel does not write shows."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    monkeypatch.setattr(torch, "empty", empty)


def reference(q, k, v, causal, scale=None):
    """float64 SDPA with an explicit bottom-right causal mask and K/V repeated per query group."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    seq_q, seq_k = q.shape[2], k.shape[2]
    mask = None
    if causal:
        i = torch.arange(seq_q)[:, None] + (seq_k - seq_q)
        mask = torch.arange(seq_k)[None, :] <= i
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def make_qkv(case, dtype):
    batch, n_q, n_kv, seq_q, seq_k, head_dim = case
    q = torch.randn(batch, n_q, seq_q, head_dim).to(dtype)
    k = torch.randn(batch, n_kv, seq_k, head_dim).to(dtype)
    v = torch.randn(batch, n_kv, seq_k, head_dim).to(dtype)
    return q, k, v


@pytest.mark.parametrize("backend", ["triton_backend", "torch_backend"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_matches_float64_sdpa(request, poison, backend, case, dtype, atol, rtol, causal):
    request.getfixturevalue(backend)
    q, k, v = make_qkv(case, dtype)
    out = flash_attention(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, k, v, causal), atol=atol, rtol=rtol)


@pytest.mark.parametrize("backend", ["triton_backend", "torch_backend"])
def test_custom_scale_and_strided_inputs(request, poison, backend):
    """q/k/v as [B, S, H, D] buffers viewed as [B, H, S, D] (what a fused QKV projection gives)."""
    request.getfixturevalue(backend)
    q = torch.randn(2, 19, 4, 48).transpose(1, 2)
    k = torch.randn(2, 25, 2, 48).transpose(1, 2)
    v = torch.randn(2, 25, 2, 48).transpose(1, 2)
    out = flash_attention(q, k, v, causal=True, scale=0.3)
    torch.testing.assert_close(out.double(), reference(q, k, v, True, scale=0.3), atol=2e-5, rtol=1e-4)


def test_chunked_prefill_equals_full_prefill(triton_backend):
    """Two causal chunks over a growing prefix give the rows of one full causal pass."""
    q, k, v = make_qkv((1, 4, 2, 48, 48, 64), torch.float32)
    full = flash_attention(q, k, v)
    first = flash_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20])
    second = flash_attention(q[:, :, 20:], k, v)
    torch.testing.assert_close(torch.cat((first, second), dim=2), full, atol=2e-6, rtol=1e-5)


def test_gradient_request_takes_the_differentiable_path(triton_backend):
    q, k, v = (t.requires_grad_(True) for t in make_qkv((1, 2, 1, 5, 9, 16), torch.float32))
    flash_attention(q, k, v).sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_bad_shapes_are_rejected():
    q, k, v = make_qkv((1, 3, 2, 4, 4, 16), torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        flash_attention(q, k, v)
    q, k, v = make_qkv((1, 2, 1, 8, 4, 16), torch.float32)
    with pytest.raises(ValueError, match="Sq <= Sk"):
        flash_attention(q, k, v, causal=True)


# int8 QK^T. The logits S = scale * q.k are computed from per-row int8 codes; rounding to the
# nearest code leaves each element off by <= s/2 (s = amax/127), uniform, so std s/sqrt(12).
# For unit-normal rows with D = 64, amax ~ 3 -> s/sqrt(12) ~ 0.007, and the logit error is
# scale * sqrt(2 D) * 0.007 ~ 0.01 (std). A softmax perturbed by at most eps in every logit moves
# each probability by a factor within e^(+-2 eps), so |dO| <= (e^(2 eps) - 1) * max|v|; with
# eps ~ 4 sigma ~ 0.04 that is ~0.08 * max|v| in the worst row and ~0.01 typically.
INT8_ATOL_VS_FLOAT = 0.1
INT8_MEAN_ERR_VS_FLOAT = 0.01
INT8_CASES = [
    (1, 2, 1, 1, 40, 64),
    (2, 4, 2, 13, 50, 64),
    (1, 2, 2, 33, 33, 80),
    (1, 4, 1, 20, 70, 16),
]


@pytest.mark.parametrize("backend", ["triton_backend", "torch_backend"])
@pytest.mark.parametrize("case", INT8_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_int8(request, poison, backend, case, dtype, causal):
    request.getfixturevalue(backend)
    q, k, v = make_qkv(case, dtype)
    out = flash_attention_int8(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    # 1) the int8 arithmetic itself: equal to float64 attention on the dequantised Q and K, up to
    #    the float tolerance of the dtype (int32 accumulation is exact).
    q_i8, q_scale = quantize_rows_int8(q)
    k_i8, k_scale = quantize_rows_int8(k)
    q_deq = q_i8.double() * q_scale.double()[..., None]
    k_deq = k_i8.double() * k_scale.double()[..., None]
    atol, rtol = next((a, r) for d, a, r in TOLERANCES if d == dtype)
    torch.testing.assert_close(out.double(), reference(q_deq, k_deq, v, causal), atol=atol, rtol=rtol)
    # 2) against exact float64 attention: the quantisation error bound derived above.
    err = (out.double() - reference(q, k, v, causal)).abs()
    assert err.max() < INT8_ATOL_VS_FLOAT + atol
    assert err.mean() < INT8_MEAN_ERR_VS_FLOAT + atol


def test_int8_rows_roundtrip_within_half_a_step():
    x = torch.randn(3, 5, 80)
    x[0, 0] = 0.0  # an all-zero row
    x_i8, scale = quantize_rows_int8(x)
    assert x_i8.dtype == torch.int8 and x_i8.abs().max() <= 127
    assert torch.all((x_i8.float() * scale[..., None] - x).abs() <= scale[..., None] / 2 * (1 + 1e-6))
    assert torch.all(x_i8[0, 0] == 0)
    assert math.isclose(float(scale[1, 1]), float(x[1, 1].abs().max()) / 127, rel_tol=1e-6)
