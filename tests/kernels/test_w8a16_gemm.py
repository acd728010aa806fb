"""w8a16_gemm (and the float `linear` on the same kernel) against float64 references."""

from __future__ import annotations

import importlib

import pytest
import torch

from tessel.errors import TesselError
from tessel.kernels import w8a16_gemm
from tessel.kernels.autotune import FLOAT_GEMM_CONFIGS

w8a16_module = importlib.import_module("tessel.kernels.w8a16_gemm")
linear = w8a16_module.linear

# Outputs are O(1). The kernel multiplies exact inputs with float32 accumulation and rounds once
# to x's dtype; the PyTorch path also rounds the dequantised weight to x's dtype first, which adds
# a random-walk error of about one ulp of the weights over K terms. So: a couple of output ulps.
TOLERANCES = {  # x dtype: (atol, rtol)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2.5e-2, 2.5e-2),
}
SHAPES = [(1, 1, 1), (5, 123, 123), (37, 45, 70), (64, 32, 96), (17, 130, 33)]  # (M, N, K)


def make_inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool):
    x = torch.randn(m, k).to(dtype)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    w_scale = (0.5 + torch.rand(n)) / (127 * k**0.5)
    b = torch.randn(n) * 0.1 if bias else None
    return x, w, w_scale, b


def reference(x, w, w_scale, bias):
    out = x.double() @ (w.double() * w_scale.double()[:, None]).t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_w8a16_matches_float64(backend: str, m: int, n: int, k: int, bias: bool, dtype: torch.dtype) -> None:
    x, w, w_scale, b = make_inputs(m, n, k, dtype, bias)
    out = w8a16_gemm(x, w, w_scale, b)
    assert out.dtype == dtype and out.shape == (m, n)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), reference(x, w, w_scale, b), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("m,n,k", SHAPES[1:])
def test_linear_matches_float64(backend: str, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x = torch.randn(m, k).to(dtype)
    weight = (torch.randn(n, k) / k**0.5).to(dtype)
    bias = (torch.randn(n) * 0.1).to(dtype)
    out = linear(x, weight, bias)
    atol, rtol = TOLERANCES[dtype]
    expected = x.double() @ weight.double().t() + bias.double()
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def test_w8a16_strided_operands(backend: str) -> None:
    x = torch.randn(30, 90)[::3, 5:85]  # [10, 80], row stride 270
    w = torch.randint(-127, 128, (80, 21), dtype=torch.int8).t()  # [21, 80] column-major
    w_scale = torch.rand(21) / 500
    out = w8a16_gemm(x, w, w_scale)
    torch.testing.assert_close(out.double(), reference(x, w, w_scale, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config", FLOAT_GEMM_CONFIGS, ids=str)
def test_w8a16_every_autotune_config(triton_backend: None, monkeypatch: pytest.MonkeyPatch, config) -> None:
    monkeypatch.setattr(w8a16_module._TUNERS["w8a16_gemm"], "default", config)
    x, w, w_scale, b = make_inputs(37, 45, 70, torch.float16, bias=True)
    out = w8a16_gemm(x, w, w_scale, b)
    torch.testing.assert_close(out.double(), reference(x, w, w_scale, b), atol=3e-3, rtol=3e-3)


def test_w8a16_empty_k_gives_bias(backend: str) -> None:
    b = torch.randn(4)
    out = w8a16_gemm(torch.empty(3, 0), torch.empty(4, 0, dtype=torch.int8), torch.ones(4), b)
    torch.testing.assert_close(out, b.expand(3, 4))


@pytest.mark.parametrize(
    "change",
    [
        {"x": torch.zeros(4, 8, dtype=torch.int8)},
        {"w": torch.zeros(5, 8)},  # float weight
        {"w": torch.zeros(5, 9, dtype=torch.int8)},  # K mismatch
        {"w_scale": torch.ones(4)},
        {"bias": torch.ones(6)},
    ],
)
def test_w8a16_rejects_bad_inputs(change: dict) -> None:
    args = {
        "x": torch.zeros(4, 8),
        "w": torch.zeros(5, 8, dtype=torch.int8),
        "w_scale": torch.ones(5),
        "bias": None,
    }
    args.update(change)
    with pytest.raises(TesselError):
        w8a16_gemm(**args)


def test_linear_rejects_mixed_dtypes() -> None:
    with pytest.raises(TesselError):
        linear(torch.zeros(2, 3), torch.zeros(4, 3, dtype=torch.float16))


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_w8a16_torch_path_dequantises_in_row_blocks(
    torch_backend: None, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """With a tiny block budget the 45 weight rows go through in 16-row blocks (16, 16, 13)."""
    monkeypatch.setattr(w8a16_module, "DEQUANT_CHUNK_ELEMENTS", 64)
    x, w, w_scale, b = make_inputs(37, 45, 70, dtype, bias=True)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(
        w8a16_gemm(x, w, w_scale, b).double(), reference(x, w, w_scale, b), atol=atol, rtol=rtol
    )
