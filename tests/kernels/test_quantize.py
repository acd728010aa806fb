"""quantize_per_token against a float64 reference, under the Triton interpreter and on the PyTorch path."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessel.errors import TesselError
from tessel.kernels import quantize_per_token

quantize_module = importlib.import_module("tessel.kernels.quantize_rows")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (M, K): K = 9000 > MAX_SINGLE_PASS_K takes the kernel's two-pass branch.
SHAPES = [(1, 1), (5, 123), (37, 70), (3, 9000)]


def check_against_float64(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    x64 = x.double()
    amax = x64.abs().amax(dim=1).clamp_min(quantize_module.EPS)
    # The scale is float32(amax / 127) (one rounding: float32 division of an exact float32 amax).
    torch.testing.assert_close(scale.double(), amax / 127, atol=0, rtol=2**-23)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.dtype == torch.float32
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    # q = round-half-even(x / scale) with the float32 scale actually returned. The float32 division
    # may land on the other side of a .5 tie only when x / scale is within float32 error of it.
    y = x64 / scale.double()[:, None]
    expected = torch.round(y)
    near_tie = ((y - torch.floor(y)) - 0.5).abs() < 1e-4
    diff = (q.double() - expected).abs()
    assert torch.all(diff[~near_tie] == 0)
    assert torch.all(diff <= 1)
    # Every non-zero row uses the full range: its absmax element maps to +-127.
    nonzero = x64.abs().amax(dim=1) > 0
    assert torch.all(q.abs().amax(dim=1)[nonzero] == 127)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", SHAPES)
def test_quantize_matches_float64(backend: str, m: int, k: int, dtype: torch.dtype) -> None:
    x = (torch.randn(m, k) * torch.rand(m, 1) * 10).to(dtype)
    q, scale = quantize_per_token(x)
    check_against_float64(x, q, scale)


def test_quantize_zero_row_and_ties(backend: str) -> None:
    # Row 0: exact .5 ties after scaling (amax 127 -> scale 1), which must round half to even.
    ties = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5, 0.49999997, -0.49999997]
    x = torch.zeros(3, len(ties))
    x[0] = torch.tensor(ties)
    x[2] = -torch.arange(len(ties), dtype=torch.float32)
    q, scale = quantize_per_token(x)
    assert q[0].tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -126, 4, 0, 0]
    assert torch.all(q[1] == 0) and 0 < float(scale[1]) < 1e-9
    check_against_float64(x, q, scale)


def test_quantize_strided_input(backend: str) -> None:
    base = torch.randn(50, 30)
    x = base.t()[:, 3:40]  # [30, 37] with column stride 30
    q, scale = quantize_per_token(x)
    check_against_float64(x, q, scale)


def test_quantize_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interpreter kernel and PyTorch path give identical q and scales (same float32 operations)."""
    x = torch.randn(21, 333) * 3
    monkeypatch.setenv("TESSEL_KERNEL_BACKEND", "torch")
    q_torch, s_torch = quantize_per_token(x)
    monkeypatch.setenv("TESSEL_KERNEL_BACKEND", "triton")
    q_triton, s_triton = quantize_per_token(x)
    assert torch.equal(q_torch, q_triton) and torch.equal(s_torch, s_triton)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 50),
    magnitude=st.sampled_from([1e-6, 1.0, 1e4]),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantize_roundtrip_error_is_half_a_step(rows: int, cols: int, magnitude: float, seed: int) -> None:
    """|x - q * scale| <= scale / 2 (plus float32 rounding) for any shape and magnitude (PyTorch path)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * magnitude
    q, scale = quantize_module._quantize_torch(x)
    err = (x.double() - q.double() * scale.double()[:, None]).abs()
    assert torch.all(err <= scale.double()[:, None] * (0.5 + 1e-5))


@pytest.mark.parametrize("bad", [torch.zeros(2, 3, 4), torch.zeros(3, 4, dtype=torch.int32)])
def test_quantize_rejects_bad_inputs(bad: torch.Tensor) -> None:
    with pytest.raises(TesselError):
        quantize_per_token(bad)


def test_quantize_empty(backend: str) -> None:
    q, scale = quantize_per_token(torch.zeros(4, 0))
    assert q.shape == (4, 0) and scale.shape == (4,)
