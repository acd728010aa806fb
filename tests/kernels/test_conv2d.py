"""conv2d (implicit GEMM) against torch's float64 convolution."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from tessel.errors import TesselError
from tessel.kernels import conv2d
from tessel.kernels.autotune import CONV_CONFIGS

conv2d_module = importlib.import_module("tessel.kernels.conv2d")

# K = C*KH*KW <= 54 here; float32 accumulation, one rounding to the output dtype (outputs O(1)).
TOLERANCES = {  # dtype: (atol, rtol)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# (N, C, H, W, OC, KH, KW, stride, padding, dilation, groups)
CASES = [
    (1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1),
    (2, 3, 9, 11, 5, 3, 3, 1, 1, 1, 1),
    (1, 6, 10, 7, 4, 3, 2, 2, (2, 1), (1, 2), 2),
    (3, 4, 5, 5, 8, 1, 1, 1, 0, 1, 4),  # depthwise-style multiplier 2
    (2, 5, 13, 6, 33, 2, 3, (2, 1), (0, 1), 1, 1),  # OC > one 32-wide tile
    (1, 3, 17, 19, 7, 5, 5, 3, 2, 1, 1),
]


def make_case(case, dtype: torch.dtype, bias: bool = True):
    n, c, h, w, oc, kh, kw, stride, padding, dilation, groups = case
    x = torch.randn(n, c, h, w).to(dtype)
    weight = (torch.randn(oc, c // groups, kh, kw) / (c // groups * kh * kw) ** 0.5).to(dtype)
    b = (torch.randn(oc) * 0.1).to(dtype) if bias else None
    return x, weight, b, dict(stride=stride, padding=padding, dilation=dilation, groups=groups)


def reference(x, weight, b, conf):
    return F.conv2d(x.double(), weight.double(), None if b is None else b.double(), **conf)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_conv2d_matches_float64(backend: str, case, dtype: torch.dtype) -> None:
    x, weight, b, conf = make_case(case, dtype)
    out = conv2d(x, weight, b, **conf)
    expected = reference(x, weight, b, conf)
    assert out.dtype == dtype and out.shape == expected.shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def test_conv2d_without_bias_positional_args(backend: str) -> None:
    x, weight, _, _ = make_case(CASES[1], torch.float32, bias=False)
    out = conv2d(x, weight, None, 2, 1, 1)
    expected = reference(x, weight, None, dict(stride=2, padding=1))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_conv2d_channels_last_and_sliced_input(backend: str) -> None:
    """Strides, not layout, drive the kernel: NHWC memory and a cropped view give the same result."""
    x = torch.randn(2, 4, 12, 12).to(memory_format=torch.channels_last)[:, :, 1:10, 2:11]
    weight = torch.randn(6, 4, 3, 3) / 6
    out = conv2d(x, weight, padding=1)
    torch.testing.assert_close(
        out.double(), reference(x, weight, None, dict(padding=1)), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("config", CONV_CONFIGS, ids=str)
def test_conv2d_every_autotune_config(triton_backend: None, monkeypatch: pytest.MonkeyPatch, config) -> None:
    monkeypatch.setattr(conv2d_module._TUNER, "default", config)
    x, weight, b, conf = make_case(CASES[4], torch.float16)
    out = conv2d(x, weight, b, **conf)
    torch.testing.assert_close(out.double(), reference(x, weight, b, conf), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"x": torch.zeros(1, 3, 5)},  # not 4-D
        {"weight": torch.zeros(4, 3, 3, 3, dtype=torch.float16)},  # dtype mismatch
        {"groups": 2},  # 3 channels do not split in 2
        {"stride": 0},
        {"padding": (1, 2, 3)},
        {"x": torch.zeros(1, 3, 2, 2)},  # smaller than the kernel
        {"bias": torch.zeros(5)},
    ],
)
def test_conv2d_rejects_bad_inputs(kwargs: dict) -> None:
    args = {"x": torch.zeros(1, 3, 8, 8), "weight": torch.zeros(4, 3, 3, 3), "bias": None}
    args.update(kwargs)
    x, weight, bias = args.pop("x"), args.pop("weight"), args.pop("bias")
    with pytest.raises(TesselError):
        conv2d(x, weight, bias, **args)
