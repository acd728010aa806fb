"""int8_gemm against a float64 reference, under the Triton interpreter and on the PyTorch path."""

from __future__ import annotations

import importlib

import pytest
import torch

from tessel.errors import TesselError
from tessel.kernels import int8_gemm
from tessel.kernels.autotune import INT8_GEMM_CONFIGS

# `import tessel.kernels.int8_gemm as m` would give the function (the package keeps op names bound
# to the ops), so the module itself comes from importlib.
int8_gemm_module = importlib.import_module("tessel.kernels.int8_gemm")

# The int32 dot product is exact; the float32 epilogue adds ~1e-7 relative error; what is left
# is one rounding to the output dtype (half an ulp: 2**-11 for float16, 2**-8 for bfloat16).
TOLERANCES = {  # out_dtype: (atol, rtol); outputs are O(1) by construction of the scales
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}
SHAPES = [(1, 1, 1), (5, 123, 123), (37, 45, 70), (64, 32, 96), (17, 130, 33)]  # (M, N, K)


def make_inputs(m: int, n: int, k: int, bias: bool):
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    a_scale = (0.5 + torch.rand(m)) / (127 * k**0.5)
    w_scale = (0.5 + torch.rand(n)) / 127
    b = torch.randn(n) if bias else None
    return a, w, a_scale, w_scale, b


def reference(a, w, a_scale, w_scale, bias):
    out = (a.double() @ w.double().t()) * a_scale.double()[:, None] * w_scale.double()[None, :]
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("out_dtype", list(TOLERANCES))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_gemm_matches_float64(backend: str, m: int, n: int, k: int, bias: bool, out_dtype) -> None:
    a, w, a_scale, w_scale, b = make_inputs(m, n, k, bias)
    out = int8_gemm(a, w, a_scale, w_scale, b, out_dtype=out_dtype)
    atol, rtol = TOLERANCES[out_dtype]
    assert out.dtype == out_dtype and out.shape == (m, n)
    torch.testing.assert_close(out.double(), reference(a, w, a_scale, w_scale, b), atol=atol, rtol=rtol)


@pytest.mark.parametrize("path", ["int_mm", "fp16codes", "dequant"])
@pytest.mark.parametrize("m,n,k", [(1, 7, 5), (37, 45, 70), (33, 19, 1000)])
def test_int8_gemm_on_each_cpu_path(
    torch_backend: None, monkeypatch, path: str, m: int, n: int, k: int
) -> None:
    """The torch path's CPU GEMM follows the CPU (`_int_mm` with VNNI, float32 sums of the codes
    otherwise): forced either way, the integer sums are exact (K = 1000 reaches 16 129 000 < 2**24)."""
    monkeypatch.setenv("TESSEL_INT8_PATH", path)
    a, w, a_scale, w_scale, b = make_inputs(m, n, k, True)
    a[0], w[0] = -127, -127  # the largest sum
    out = int8_gemm(a, w, a_scale, w_scale, b, out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), reference(a, w, a_scale, w_scale, b), atol=1e-5, rtol=1e-5)


def test_int8_gemm_default_out_dtype_is_float16(backend: str) -> None:
    a, w, a_scale, w_scale, _ = make_inputs(9, 10, 11, bias=False)
    assert int8_gemm(a, w, a_scale, w_scale).dtype == torch.float16


def test_int8_gemm_strided_operands(backend: str) -> None:
    """Row-sliced activations and a column-major weight view ([N, K] with strides (1, N))."""
    a_full = torch.randint(-127, 128, (40, 150), dtype=torch.int8)
    a = a_full[::2, 7:107]  # [20, 100], non-contiguous rows
    w = torch.randint(-127, 128, (100, 33), dtype=torch.int8).t()  # [33, 100] column-major
    a_scale = torch.rand(20) / 1000
    w_scale = torch.rand(33) / 100
    out = int8_gemm(a, w, a_scale, w_scale, out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), reference(a, w, a_scale, w_scale, None), atol=1e-5, rtol=1e-5)


def test_int8_gemm_extreme_values_accumulate_exactly(backend: str) -> None:
    """-127 * -127 summed over K = 1000 is 16 129 000: exact in int32, and after the scales too."""
    k = 1000
    a = torch.full((17, k), -127, dtype=torch.int8)
    w = torch.full((19, k), -127, dtype=torch.int8)
    ones_m, ones_n = torch.ones(17), torch.ones(19)
    out = int8_gemm(a, w, ones_m, ones_n, out_dtype=torch.float32)
    assert torch.all(out == 127 * 127 * k)


@pytest.mark.parametrize("config", INT8_GEMM_CONFIGS, ids=str)
def test_int8_gemm_every_autotune_config(
    triton_backend: None, monkeypatch: pytest.MonkeyPatch, config
) -> None:
    """Each candidate tile (the ones CUDA autotuning picks from) gives the right answer on odd shapes."""
    monkeypatch.setattr(int8_gemm_module._TUNER, "default", config)
    a, w, a_scale, w_scale, b = make_inputs(37, 45, 70, bias=True)
    out = int8_gemm(a, w, a_scale, w_scale, b, out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), reference(a, w, a_scale, w_scale, b), atol=1e-5, rtol=1e-5)


def test_int8_gemm_empty_k_gives_bias(backend: str) -> None:
    a = torch.empty((3, 0), dtype=torch.int8)
    w = torch.empty((4, 0), dtype=torch.int8)
    b = torch.randn(4)
    out = int8_gemm(a, w, torch.ones(3), torch.ones(4), b, out_dtype=torch.float32)
    torch.testing.assert_close(out, b.expand(3, 4))


@pytest.mark.parametrize(
    "change",
    [
        {"a": torch.zeros(4, 8)},  # float activations
        {"w": torch.zeros(5, 9, dtype=torch.int8)},  # K mismatch
        {"a_scale": torch.ones(3)},  # wrong length
        {"w_scale": torch.ones(5, dtype=torch.float64)},  # wrong dtype
        {"bias": torch.ones(4)},  # wrong length
        {"out_dtype": torch.int32},
    ],
)
def test_int8_gemm_rejects_bad_inputs(change: dict) -> None:
    args = {
        "a": torch.zeros(4, 8, dtype=torch.int8),
        "w": torch.zeros(5, 8, dtype=torch.int8),
        "a_scale": torch.ones(4),
        "w_scale": torch.ones(5),
        "bias": None,
        "out_dtype": torch.float16,
    }
    args.update(change)
    with pytest.raises(TesselError):
        int8_gemm(**args)


@pytest.mark.parametrize("m,n,k", SHAPES[1:3])
def test_int8_gemm_fp16_dot_fallback(triton_backend: None, monkeypatch: pytest.MonkeyPatch, m, n, k) -> None:
    """The pre-sm_80 path (int8 tiles multiplied as fp16, fp32 accumulation) gives the same result."""
    monkeypatch.setattr(int8_gemm_module, "int8_tensor_cores", lambda device: False)
    a, w, a_scale, w_scale, b = make_inputs(m, n, k, bias=True)
    out = int8_gemm(a, w, a_scale, w_scale, b, out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), reference(a, w, a_scale, w_scale, b), atol=1e-5, rtol=1e-5)
