"""softmax / masked softmax / log_softmax and their gradients against float64 references."""

from __future__ import annotations

import pytest
import torch

from tessel.kernels import log_softmax, softmax

# (dtype, atol, rtol) for the forward: fp32 math, one rounding to dtype; probabilities <= 1 and
# log-probabilities of size ~10 (hence the larger atol for log_softmax in half precision).
TOLERANCES = [
    (torch.float32, 1e-6, 1e-5),
    (torch.float16, 1e-3, 2e-3),
    (torch.bfloat16, 8e-3, 1.6e-2),
]
SHAPES = [(1, 1), (5, 123), (2, 3, 70), (2, 9000)]  # 9000 fp32 > one 8192-wide tile: two-pass path
MASKS = ["none", "bool", "additive"]


def make_mask(kind: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32):
    if kind == "none":
        return None
    keep = torch.rand(shape) > 0.4
    keep.view(-1, shape[-1])[0] = True  # a full row
    if keep.numel() // shape[-1] > 1:
        keep.view(-1, shape[-1])[-1] = False  # a fully masked row: zeros, not NaN
    if kind == "bool":
        return keep
    return torch.zeros(shape, dtype=dtype).masked_fill(~keep, float("-inf"))


def reference_softmax(x, mask):
    z = x.double()
    if mask is not None:
        z = z.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else z + mask.double()
    dead = (z == float("-inf")).all(-1, keepdim=True)
    return torch.softmax(z.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("mask_kind", MASKS)
def test_softmax_forward(backend, shape, dtype, atol, rtol, mask_kind):
    x = (3 * torch.randn(shape)).to(dtype)
    mask = make_mask(mask_kind, shape, dtype)
    y = softmax(x, mask)
    assert y.dtype == dtype and y.shape == x.shape
    assert not y.isnan().any()
    torch.testing.assert_close(y.double(), reference_softmax(x, mask), atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
def test_log_softmax_forward(backend, shape, dtype, atol, rtol):
    x = (3 * torch.randn(shape)).to(dtype)
    y = log_softmax(x)
    assert y.dtype == dtype and y.shape == x.shape
    ref = torch.log_softmax(x.double(), -1)
    torch.testing.assert_close(y.double(), ref, atol=atol * 20, rtol=rtol)


def test_mask_broadcasts_over_leading_dims(backend):
    x = torch.randn(2, 3, 5, 9)
    causal = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)  # [Sq, Sk], bottom-right aligned
    torch.testing.assert_close(softmax(x, causal).double(), reference_softmax(x, causal.expand_as(x)))


@pytest.mark.parametrize("shape", [(5, 123), (2, 3, 70), (2, 9000)])
@pytest.mark.parametrize("mask_kind", MASKS)
def test_triton_softmax_backward_matches_float64_autograd(triton_backend, shape, mask_kind):
    x = torch.randn(shape)
    mask = make_mask(mask_kind, shape)
    grad_out = torch.randn(shape)
    x_t = x.clone().requires_grad_(True)
    softmax(x_t, mask).backward(grad_out)
    x_ref = x.double().requires_grad_(True)
    reference_softmax(x_ref, mask).backward(grad_out.double())
    assert not x_t.grad.isnan().any()
    torch.testing.assert_close(x_t.grad.double(), x_ref.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(5, 123), (2, 3, 70), (2, 9000)])
def test_triton_log_softmax_backward_matches_float64_autograd(triton_backend, shape):
    x, grad_out = torch.randn(shape), torch.randn(shape)
    x_t = x.clone().requires_grad_(True)
    log_softmax(x_t).backward(grad_out)
    x_ref = x.double().requires_grad_(True)
    torch.log_softmax(x_ref, -1).backward(grad_out.double())
    # dx = g - p * sum(g): the sum over 9000 columns is ~100, so its fp32 error scales atol
    torch.testing.assert_close(x_t.grad.double(), x_ref.grad, atol=2e-5, rtol=1e-5)


def test_triton_half_precision_backward(triton_backend):
    x = torch.randn(4, 77, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(4, 77, dtype=torch.bfloat16)
    softmax(x).backward(grad_out)
    x_ref = x.detach().double().requires_grad_(True)
    torch.softmax(x_ref, -1).backward(grad_out.double())
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.double(), x_ref.grad, atol=1e-2, rtol=1.6e-2)


def test_additive_mask_gets_a_gradient_summed_to_its_shape(backend):
    x = torch.randn(3, 4, 10)
    bias = (0.5 * torch.randn(4, 10)).requires_grad_(True)  # e.g. a learned position bias
    grad_out = torch.randn(3, 4, 10)
    softmax(x, bias).backward(grad_out)
    bias_ref = bias.detach().double().requires_grad_(True)
    torch.softmax(x.double() + bias_ref, -1).backward(grad_out.double())
    torch.testing.assert_close(bias.grad.double(), bias_ref.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mask_kind", MASKS)
def test_torch_path_gradcheck(torch_backend, mask_kind):
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    mask = make_mask(mask_kind, (4, 7), torch.float64)
    # fast_mode: checks the Jacobian along random directions (full mode is ~20x slower here)
    assert torch.autograd.gradcheck(lambda t: softmax(t, mask), (x,), fast_mode=True)
    assert torch.autograd.gradcheck(log_softmax, (x,), fast_mode=True)


def test_fully_masked_rows_are_zero_with_zero_gradient(backend):
    x = torch.randn(3, 6, requires_grad=True)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1] = False
    y = softmax(x, mask)
    y.backward(torch.randn(3, 6))
    assert torch.equal(y[1].detach(), torch.zeros(6))
    assert torch.equal(x.grad[1], torch.zeros(6))
    assert not x.grad.isnan().any()


def test_integer_mask_is_rejected():
    with pytest.raises(ValueError, match="mask"):
        softmax(torch.randn(2, 3), torch.ones(2, 3, dtype=torch.int64))


def test_empty_inputs(backend):
    assert softmax(torch.randn(0, 5)).shape == (0, 5)
    assert log_softmax(torch.randn(3, 0)).shape == (3, 0)
