"""rms_norm against a float64 reference, on the Triton kernel (interpreter) and the PyTorch path."""

from __future__ import annotations

import pytest
import torch

from tessel.kernels import rms_norm

# (dtype, atol, rtol): the output passes through three roundings to dtype (x + residual, the
# normalised row, the weight product), so a few ulps of the dtype on values of size ~5.
TOLERANCES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 1e-2, 4e-3),
    (torch.bfloat16, 8e-2, 2e-2),
]
SHAPES = [(1, 16), (5, 123), (2, 3, 64), (3, 5000), (2, 40000)]  # 40000 fp32 > one tile: chunked path


def reference(x, weight, eps, residual=None):
    s = x.double() if residual is None else x.double() + residual.double()
    out = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return out, s


def _check(x, weight, residual, atol, rtol):
    eps = 1e-6
    ref_out, ref_s = reference(x, weight, eps, residual)
    if residual is None:
        out = rms_norm(x, weight, eps)
    else:
        out, new_residual = rms_norm(x, weight, eps, residual)
        assert new_residual.dtype == x.dtype and new_residual.shape == x.shape
        torch.testing.assert_close(new_residual.double(), ref_s, atol=atol, rtol=rtol)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_float64(backend, shape, dtype, atol, rtol, with_residual):
    x = torch.randn(shape, dtype=dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1])).to(dtype)
    residual = torch.randn(shape, dtype=dtype) if with_residual else None
    _check(x, weight, residual, atol, rtol)


def test_rms_norm_strided_input_and_fp32_weight(backend):
    base = torch.randn(6, 2 * 96, dtype=torch.bfloat16)
    x = base[:, :96]  # row stride 192
    weight = 1 + 0.5 * torch.randn(96)  # fp32 weight on bf16 activations
    residual = torch.randn(6, 96, dtype=torch.bfloat16)
    _check(x, weight, residual, 8e-2, 2e-2)


def test_triton_matches_the_hf_convention_of_the_torch_path(monkeypatch):
    """The kernel rounds x + residual and the normalised row to x.dtype before the weight product,
    as HF does: it agrees with the torch path to an ulp or two (the interpreter truncates
    fp32 -> bf16 where a GPU rounds to nearest, so one ulp per rounding)."""
    pytest.importorskip("triton")
    x = torch.randn(4, 77, dtype=torch.bfloat16)
    residual = torch.randn(4, 77, dtype=torch.bfloat16)
    weight = torch.randn(77, dtype=torch.bfloat16)
    monkeypatch.setenv("TESSEL_KERNEL_BACKEND", "torch")
    out_t, res_t = rms_norm(x, weight, 1e-5, residual)
    monkeypatch.setenv("TESSEL_KERNEL_BACKEND", "triton")
    out_k, res_k = rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(res_k, res_t, atol=0, rtol=2**-7)
    torch.testing.assert_close(out_k, out_t, atol=0, rtol=3 * 2**-7)


def test_gradient_request_takes_the_differentiable_path(triton_backend):
    x = torch.randn(3, 32, requires_grad=True)
    weight = torch.randn(32, requires_grad=True)
    out = rms_norm(x, weight, 1e-6)
    out.sum().backward()
    assert x.grad is not None and weight.grad is not None


def test_residual_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, torch.randn(3, 8))


def test_no_tokens(backend):
    out, new_residual = rms_norm(torch.randn(0, 8), torch.ones(8), 1e-6, torch.randn(0, 8))
    assert out.shape == new_residual.shape == (0, 8)


@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (7, 123), (64, 4096), (3, 17)])
def test_float32_torch_path_is_bit_equal_to_the_hf_formula(torch_backend, rows, hidden):
    """The float32 PyTorch path runs torch's fused rms_norm; it must equal LlamaRMSNorm's ops bit for bit."""
    x, r, weight = torch.randn(rows, hidden) * 3, torch.randn(rows, hidden), torch.randn(hidden)
    out, s = rms_norm(x, weight, 1e-5, r)
    expected_s = x + r
    expected = (expected_s * torch.rsqrt(expected_s.pow(2).mean(-1, keepdim=True) + 1e-5)) * weight
    assert torch.equal(s, expected_s) and torch.equal(out, expected)
