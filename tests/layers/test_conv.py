"""tessel.layers.Conv2d against nn.Conv2d with the same parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessel.layers import Conv2d

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}

# nn.Conv2d keyword arguments: int and string padding, padding modes, groups, dilation, stride.
CONFIGS = [
    dict(in_channels=3, out_channels=5, kernel_size=3, padding=1),
    dict(
        in_channels=4, out_channels=6, kernel_size=(3, 2), stride=2, padding=(1, 0), dilation=(2, 1), groups=2
    ),
    dict(in_channels=3, out_channels=4, kernel_size=3, padding="same", dilation=2, bias=False),
    dict(in_channels=3, out_channels=4, kernel_size=4, padding="same"),  # asymmetric 'same'
    dict(in_channels=2, out_channels=3, kernel_size=3, padding="valid"),
    dict(in_channels=3, out_channels=3, kernel_size=3, padding=2, padding_mode="reflect"),
    dict(in_channels=2, out_channels=4, kernel_size=3, padding=1, padding_mode="circular"),
]


@pytest.fixture(params=["triton_backend", "torch_backend"])
def backend(request: pytest.FixtureRequest) -> str:
    request.getfixturevalue(request.param)
    return request.param


@pytest.mark.filterwarnings("ignore:Using padding=.same.:UserWarning")
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_conv2d_layer_matches_nn_conv2d(backend: str, config: dict) -> None:
    ref = nn.Conv2d(**config)
    layer = Conv2d(**config)
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(2, config["in_channels"], 9, 8)
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), ref.double()(x.double()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_conv2d_layer_dtypes_and_unbatched_input(backend: str, dtype: torch.dtype) -> None:
    ref = nn.Conv2d(3, 5, 3, padding=1)
    layer = Conv2d.from_conv(ref).to(dtype)
    x = torch.randn(3, 7, 6).to(dtype)  # [C, H, W], as nn.Conv2d also accepts
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (5, 7, 6) and out.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    weight, bias = ref.weight.to(dtype).double(), ref.bias.to(dtype).double()
    expected = nn.functional.conv2d(x.double()[None], weight, bias, padding=1)[0]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def test_conv2d_layer_gradients_match(backend: str) -> None:
    ref = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
    layer = Conv2d.from_conv(ref)
    x1 = torch.randn(2, 4, 7, 9, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    (ref(x1) ** 2).sum().backward()
    want = [x1.grad, ref.weight.grad.clone(), ref.bias.grad.clone()]
    ref.zero_grad()
    (layer(x2) ** 2).sum().backward()
    for got, expected in zip([x2.grad, layer.weight.grad, layer.bias.grad], want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
