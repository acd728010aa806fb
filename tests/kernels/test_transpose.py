"""transpose against torch's x.t(), bit for bit."""

from __future__ import annotations

import importlib

import pytest
import torch

from tessel.errors import TesselError
from tessel.kernels import transpose

transpose_module = importlib.import_module("tessel.kernels.transpose")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64, torch.bool]
SHAPES = [(1, 1), (1, 70), (37, 70), (130, 65)]  # 130 x 65: three row tiles, two column tiles


def random_tensor(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-50, 50, shape, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_transpose_exact(backend: str, shape: tuple[int, int], dtype: torch.dtype) -> None:
    x = random_tensor(shape, dtype)
    if dtype == torch.bool:
        x[0, 0] = False  # a bool poison (True) needs at least one False to be caught
    out = transpose(x)
    assert out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, x.t())


def test_transpose_of_a_strided_view(backend: str) -> None:
    base = torch.randn(50, 80)
    x = base[3:40:2, ::3]  # [19, 27], strides (160, 3)
    assert torch.equal(transpose(x), x.t())
    assert torch.equal(transpose(base.t()), base)


def test_transpose_rejects_non_2d() -> None:
    with pytest.raises(TesselError):
        transpose(torch.zeros(2, 3, 4))
