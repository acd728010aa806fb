"""Every Triton host function allocates its outputs through `_utils.empty_output`, the seam the
poisoning fixture (tests/kernels/conftest.py) replaces: a kernel that allocated elsewhere would
escape the check that it writes every output element."""

from __future__ import annotations

import importlib

import pytest
import torch

from tessel import kernels


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(1, 4, 5, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)


def _paged() -> tuple[torch.Tensor, ...]:
    cache = torch.randn(6, 4, 2, 16)
    tables = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32)
    return torch.randn(2, 4, 16), cache, cache.clone(), tables, torch.tensor([9, 5], dtype=torch.int32)


def _int8_gemm() -> torch.Tensor:
    a = torch.randint(-127, 128, (5, 24), dtype=torch.int8)
    w = torch.randint(-127, 128, (7, 24), dtype=torch.int8)
    return kernels.int8_gemm(a, w, torch.rand(5) / 127, torch.rand(7) / 127)


def _rope() -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = torch.randn(8, 8), torch.randn(8, 8)
    return kernels.rope(torch.randn(3, 4, 16), torch.randn(3, 2, 16), torch.tensor([0, 5, 7]), cos, sin)


OPS = {
    "conv2d": lambda: kernels.conv2d(torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3), padding=1),
    "flash_attention": lambda: kernels.flash_attention(*_qkv()),
    "flash_attention_int8": lambda: kernels.flash_attention_int8(*_qkv()),
    "int8_gemm": _int8_gemm,
    "layer_norm": lambda: kernels.layer_norm(torch.randn(3, 20), torch.randn(20), None, 1e-5),
    "linear": lambda: kernels.linear(torch.randn(5, 24), torch.randn(7, 24)),
    "log_softmax": lambda: kernels.log_softmax(torch.randn(3, 20)),
    "paged_decode_attention": lambda: kernels.paged_decode_attention(*_paged()),
    "quantize_per_token": lambda: kernels.quantize_per_token(torch.randn(3, 20)),
    "rms_norm": lambda: kernels.rms_norm(torch.randn(3, 20), torch.randn(20), 1e-6, torch.randn(3, 20)),
    "rope": _rope,
    "silu_and_mul": lambda: kernels.silu_and_mul(torch.randn(3, 20)),
    "softmax": lambda: kernels.softmax(torch.randn(3, 20), torch.rand(3, 20) > 0.3),
    "transpose": lambda: kernels.transpose(torch.randn(5, 7)),
    "transpose_bool": lambda: kernels.transpose(torch.rand(5, 7) > 0.5),
    "w8a16_gemm": lambda: kernels.w8a16_gemm(
        torch.randn(5, 24), torch.randint(-127, 128, (7, 24), dtype=torch.int8), torch.rand(7) / 127
    ),
}


@pytest.mark.parametrize("op", list(OPS))
def test_outputs_come_from_the_seam(triton_backend, poison_outputs, op: str) -> None:
    result = OPS[op]()
    outputs = result if isinstance(result, tuple) else (result,)
    handed_out = {_storage(buffer) for buffer in poison_outputs}
    for out in outputs:
        assert _storage(out) in handed_out, f"{op} returned a buffer the output seam did not allocate"
        assert not (out.is_floating_point() and out.isnan().any())


def test_softmax_gradient_comes_from_the_seam(triton_backend, poison_outputs) -> None:
    x = torch.randn(3, 20, requires_grad=True)
    kernels.softmax(x).square().sum().backward()
    assert len(poison_outputs) == 2  # forward output, then backward's dx
    torch.testing.assert_close(x.grad, poison_outputs[-1], atol=0, rtol=0)


def test_split_decode_partials_come_from_the_seam(triton_backend, poison_outputs) -> None:
    module = importlib.import_module("tessel.kernels.paged_decode")
    out = module._paged_decode_triton(*_paged(), 0.25, splits=3)
    assert len(poison_outputs) == 3  # out, the partial outputs and their log-sum-exps
    assert _storage(out) == _storage(poison_outputs[0])
