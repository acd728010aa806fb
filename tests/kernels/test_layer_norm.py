"""layer_norm against a float64 reference, on the Triton kernel (interpreter) and the PyTorch path."""

from __future__ import annotations

import pytest
import torch

from tessel.kernels import layer_norm

# (dtype, atol, rtol): statistics in fp32, one rounding of the output to dtype (values up to ~10).
TOLERANCES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.float16, 1e-2, 2e-3),
    (torch.bfloat16, 6e-2, 1e-2),
]
SHAPES = [(1, 16), (5, 123), (2, 3, 64), (3, 20000)]  # 20000 fp32 > one tile: chunked two-pass path


def reference(x, weight, bias, eps):
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    out = (x - mean) / torch.sqrt(var + eps)
    if weight is not None:
        out = out * weight.double()
    if bias is not None:
        out = out + bias.double()
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("affine", ["weight_bias", "weight_only", "none"])
def test_layer_norm_matches_float64(backend, shape, dtype, atol, rtol, affine):
    # an offset mean: the centred variance must not cancel catastrophically
    x = (3.0 + 2.0 * torch.randn(shape)).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1])).to(dtype) if affine != "none" else None
    bias = torch.randn(shape[-1]).to(dtype) if affine == "weight_bias" else None
    out = layer_norm(x, weight, bias, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), reference(x, weight, bias, 1e-5), atol=atol, rtol=rtol)


def test_layer_norm_strided_rows_and_fp32_params(backend):
    x = torch.randn(7, 2 * 50, dtype=torch.float16)[:, ::2]  # last dim not contiguous
    weight, bias = torch.randn(50), torch.randn(50)
    out = layer_norm(x, weight, bias, 1e-6)
    torch.testing.assert_close(out.double(), reference(x, weight, bias, 1e-6), atol=1e-2, rtol=2e-3)


def test_gradient_request_takes_the_differentiable_path(triton_backend):
    x = torch.randn(3, 32, requires_grad=True)
    weight, bias = torch.randn(32, requires_grad=True), torch.randn(32, requires_grad=True)
    layer_norm(x, weight, bias, 1e-5).pow(2).sum().backward()
    assert x.grad is not None and weight.grad is not None and bias.grad is not None


def test_no_tokens(backend):
    assert layer_norm(torch.randn(0, 8), torch.ones(8), None, 1e-5).shape == (0, 8)
