"""silu_and_mul against a float64 reference, on the Triton kernel (interpreter) and the PyTorch path."""

from __future__ import annotations

import pytest
import torch

from tessel.kernels import silu_and_mul

# (dtype, atol, rtol): one rounding of the result to dtype (the torch path rounds silu(a) first, so
# two roundings there) on values up to ~10.
TOLERANCES = [
    (torch.float32, 1e-6, 1e-5),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 2e-2, 1.6e-2),
]
SHAPES = [(1, 2), (5, 246), (2, 3, 128), (3, 2 * 1500)]  # 1500 > one column tile of 1024


def reference(x):
    x = x.double()
    a, b = x.chunk(2, dim=-1)
    return a * torch.sigmoid(a) * b


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
def test_silu_and_mul_matches_float64(backend, shape, dtype, atol, rtol):
    x = (2 * torch.randn(shape)).to(dtype)
    out = silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out.double(), reference(x), atol=atol, rtol=rtol)


def test_silu_and_mul_strided_rows(backend):
    x = torch.randn(6, 3 * 40)[:, :80]  # row stride 120, last dim contiguous
    torch.testing.assert_close(silu_and_mul(x).double(), reference(x), atol=1e-6, rtol=1e-5)


def test_odd_last_dim_is_rejected():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(3, 7))


def test_gradient_request_takes_the_differentiable_path(triton_backend):
    x = torch.randn(4, 16, requires_grad=True)
    silu_and_mul(x).sum().backward()
    assert x.grad is not None


def test_no_tokens(backend):
    assert silu_and_mul(torch.randn(0, 8)).shape == (0, 4)


_WITHOUT_TRITON = """
import sys

class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'triton':
            raise ImportError('blocked for the test: ' + name)
        return None

sys.meta_path.insert(0, _NoTriton())
import torch
from tessel.kernels import (
    flash_attention, flash_attention_int8, layer_norm, log_softmax, paged_decode_attention, rms_norm, rope,
    silu_and_mul, softmax,
)

x = torch.randn(3, 16)
rms_norm(x, torch.ones(16), 1e-6, x)
layer_norm(x, None, None, 1e-5)
silu_and_mul(x)
softmax(x, x > 0)
log_softmax(x)
rope(torch.randn(2, 2, 16), torch.randn(2, 1, 16), torch.arange(2), torch.randn(4, 8), torch.randn(4, 8))
q = torch.randn(1, 2, 3, 16)
flash_attention(q, q[:, :1], q[:, :1])
flash_attention_int8(q, q[:, :1], q[:, :1])
cache = torch.randn(2, 4, 1, 16)
tables, lens = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
paged_decode_attention(torch.randn(1, 2, 16), cache, cache, tables, lens)
assert "triton" not in sys.modules
"""


def test_ops_import_and_run_without_triton():
    """Where triton is not installed, the modules import and the PyTorch paths run."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "TESSEL_KERNEL_BACKEND"}
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
