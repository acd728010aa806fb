"""RMSNorm against HF's LlamaRMSNorm (and the fused residual add against doing it by hand)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tessel.layers.norm import RMSNorm


@pytest.mark.parametrize("shape", [(1, 8), (5, 123), (3, 7, 64)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rms_norm_matches_hf(shape: tuple[int, ...], dtype: torch.dtype, tol: float) -> None:
    hidden = shape[-1]
    ours, hf = RMSNorm(hidden, eps=1e-5), LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        weight = 1 + 0.1 * torch.randn(hidden)
        ours.weight.copy_(weight)
        hf.weight.copy_(weight)
    ours, hf = ours.to(dtype), hf.to(dtype)
    x = torch.randn(shape).to(dtype)
    residual = torch.randn(shape).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), rtol=tol, atol=tol)
        out, new_residual = ours(x, residual)
        torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
        torch.testing.assert_close(out, hf(x + residual), rtol=tol, atol=tol)
