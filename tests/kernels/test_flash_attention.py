"""flash_attention (and its int8-QK variant) against float64 SDPA, on both paths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessel.kernels import flash_attention, flash_attention_int8
from tessel.kernels.flash_attention import quantize_rows_int8

# (dtype, atol, rtol) against float64 SDPA on the same (rounded) inputs. fp32: exact fp32 dots.
# fp16/bf16: P is rounded to the input dtype for P @ V (tensor-core input) and O once at the end,
# so about two ulps of the dtype on outputs of size <= 1.
TOLERANCES = [
    (torch.float32, 2e-5, 1e-4),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 2e-2, 1.6e-2),
]
# (batch, q heads, kv heads, Sq, Sk, D): decode (Sq = 1), chunk after a prefix (Sq < Sk),
# plain prefill (Sq = Sk), Sk not a multiple of the 64 key block, non-power-of-2 D (80, 96).
CASES = [
    (1, 1, 1, 1, 1, 16),
    (2, 4, 2, 1, 37, 64),
    (1, 4, 4, 17, 17, 80),
    (2, 6, 2, 13, 50, 96),
    (1, 2, 1, 40, 100, 32),
    (1, 2, 1, 70, 70, 128),
    (1, 3, 1, 5, 130, 64),
]


def reference(q, k, v, causal, scale=None):
    """float64 SDPA with an explicit bottom-right causal mask and K/V repeated per query group."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    seq_q, seq_k = q.shape[2], k.shape[2]
    mask = None
    if causal:
        i = torch.arange(seq_q)[:, None] + (seq_k - seq_q)
        mask = torch.arange(seq_k)[None, :] <= i
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def make_qkv(case, dtype):
    batch, n_q, n_kv, seq_q, seq_k, head_dim = case
    q = torch.randn(batch, n_q, seq_q, head_dim).to(dtype)
    k = torch.randn(batch, n_kv, seq_k, head_dim).to(dtype)
    v = torch.randn(batch, n_kv, seq_k, head_dim).to(dtype)
    return q, k, v


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_matches_float64_sdpa(backend, case, dtype, atol, rtol, causal):
    q, k, v = make_qkv(case, dtype)
    out = flash_attention(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, k, v, causal), atol=atol, rtol=rtol)


def test_custom_scale_and_strided_inputs(backend):
    """q/k/v as [B, S, H, D] buffers viewed as [B, H, S, D] (what a fused QKV projection gives)."""
    q = torch.randn(2, 19, 4, 48).transpose(1, 2)
    k = torch.randn(2, 25, 2, 48).transpose(1, 2)
    v = torch.randn(2, 25, 2, 48).transpose(1, 2)
    out = flash_attention(q, k, v, causal=True, scale=0.3)
    torch.testing.assert_close(out.double(), reference(q, k, v, True, scale=0.3), atol=2e-5, rtol=1e-4)


def test_chunked_prefill_equals_full_prefill(triton_backend):
    """Two causal chunks over a growing prefix give the rows of one full causal pass."""
    q, k, v = make_qkv((1, 4, 2, 48, 48, 64), torch.float32)
    full = flash_attention(q, k, v)
    first = flash_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20])
    second = flash_attention(q[:, :, 20:], k, v)
    torch.testing.assert_close(torch.cat((first, second), dim=2), full, atol=2e-6, rtol=1e-5)


def test_gradient_request_takes_the_differentiable_path(triton_backend):
    q, k, v = (t.requires_grad_(True) for t in make_qkv((1, 2, 1, 5, 9, 16), torch.float32))
    flash_attention(q, k, v).sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_bad_shapes_are_rejected():
    q, k, v = make_qkv((1, 3, 2, 4, 4, 16), torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        flash_attention(q, k, v)
    q, k, v = make_qkv((1, 2, 1, 8, 4, 16), torch.float32)
    with pytest.raises(ValueError, match="Sq <= Sk"):
        flash_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="dtype"):
        flash_attention(q.half(), k, v, causal=False)


# int8 QK^T. The logits S = scale * q.k are computed from per-row int8 codes; rounding to the
# nearest code leaves each element off by <= s/2 (s = amax/127), uniform, so std s/sqrt(12).
# For unit-normal rows with D = 64, amax ~ 3 -> s/sqrt(12) ~ 0.007, and the logit error is
# scale * sqrt(2 D) * 0.007 ~ 0.01 (std). A softmax perturbed by at most eps in every logit moves
# each probability by a factor within e^(+-2 eps), so |dO| <= (e^(2 eps) - 1) * max|v|; with
# eps ~ 4 sigma ~ 0.04 that is ~0.08 * max|v| in the worst row and ~0.01 typically.
INT8_ATOL_VS_FLOAT = 0.1
INT8_MEAN_ERR_VS_FLOAT = 0.01
INT8_CASES = [
    (1, 2, 1, 1, 40, 64),
    (2, 4, 2, 13, 50, 64),
    (1, 2, 2, 33, 33, 80),
    (1, 4, 1, 20, 70, 16),
]


@pytest.mark.parametrize("case", INT8_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_int8(backend, case, dtype, causal):
    q, k, v = make_qkv(case, dtype)
    out = flash_attention_int8(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    # 1) the int8 arithmetic itself: equal to float64 attention on the dequantised Q and K, up to
    #    the float tolerance of the dtype (int32 accumulation is exact).
    q_i8, q_scale = quantize_rows_int8(q)
    k_i8, k_scale = quantize_rows_int8(k)
    q_deq = q_i8.double() * q_scale.double()[..., None]
    k_deq = k_i8.double() * k_scale.double()[..., None]
    atol, rtol = next((a, r) for d, a, r in TOLERANCES if d == dtype)
    torch.testing.assert_close(out.double(), reference(q_deq, k_deq, v, causal), atol=atol, rtol=rtol)
    # 2) against exact float64 attention: the quantisation error bound derived above.
    err = (out.double() - reference(q, k, v, causal)).abs()
    assert err.max() < INT8_ATOL_VS_FLOAT + atol
    assert err.mean() < INT8_MEAN_ERR_VS_FLOAT + atol


def test_int8_rows_roundtrip_within_half_a_step():
    x = torch.randn(3, 5, 80)
    x[0, 0] = 0.0  # an all-zero row
    x_i8, scale = quantize_rows_int8(x)
    assert x_i8.dtype == torch.int8 and x_i8.abs().max() <= 127
    assert torch.all((x_i8.float() * scale[..., None] - x).abs() <= scale[..., None] / 2 * (1 + 1e-6))
    assert torch.all(x_i8[0, 0] == 0)
    assert math.isclose(float(scale[1, 1]), float(x[1, 1].abs().max()) / 127, rel_tol=1e-6)


def test_int8_qk_through_fp16_mma_is_exact(triton_backend):
    """Turing has no int8 MMA: there the codes go through an fp16 dot, which must give the same
    (exact integer) logits, hence the same output as the int8 dot."""
    from tessel.kernels.flash_attention import _launch

    q, k, v = make_qkv((1, 4, 2, 21, 40, 64), torch.float16)
    via_int8 = _launch(q, k, v, True, 0.125, int8_qk=True, int8_via_fp16=False)
    via_fp16 = _launch(q, k, v, True, 0.125, int8_qk=True, int8_via_fp16=True)
    torch.testing.assert_close(via_fp16, via_int8, atol=0, rtol=0)


# Compiles the attention kernels for a real CUDA target without a GPU: Triton ships ptxas, so
# `triton.compile(ASTSource(...), target=GPUTarget("cuda", 80, 32))` runs the whole NVIDIA
# pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin). The interpreter cannot catch what only the
# compiler rejects (dot shapes and dtypes, layouts, shared memory). A subprocess, because kernels
# decorated under TRITON_INTERPRET=1 are interpreter objects.
_CUDA_COMPILE_SCRIPT = r"""
import importlib, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32"}
ARCH = int(sys.argv[1])

class Compile:
    def __init__(self, fn):
        self.fn = fn
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            names = self.fn.arg_names
            values = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
            options = {k: v for k, v in kwargs.items() if k not in names}
            sig, consts = {}, {}
            for p in self.fn.params:
                v = values[p.name]
                if p.is_constexpr:
                    sig[p.name], consts[p.name] = "constexpr", v
                elif isinstance(v, torch.Tensor):
                    sig[p.name] = "*" + DTYPES[v.dtype]
                else:
                    sig[p.name] = "fp32" if isinstance(v, float) else "i32"
            source = ASTSource(self.fn, sig, consts)
            kernel = triton.compile(source, target=GPUTarget("cuda", ARCH, 32), options=options)
            assert kernel.asm["cubin"], self.fn.__name__
            print(self.fn.__name__, consts.get("HEAD_DIM"), kernel.metadata.shared)
        return launch

fa = importlib.import_module("tessel.kernels.flash_attention")
pd = importlib.import_module("tessel.kernels.paged_decode")
fa._flash_attention_forward_kernel = Compile(fa._flash_attention_forward_kernel)
pd._paged_decode_kernel = Compile(pd._paged_decode_kernel)
pd._paged_decode_reduce_kernel = Compile(pd._paged_decode_reduce_kernel)
q, k = torch.randn(1, 4, 100, 80, dtype=torch.float16), torch.randn(1, 2, 100, 80, dtype=torch.float16)
fa._launch(q, k, k, True, 0.1, int8_qk=False)
fa._launch(q, k, k, True, 0.1, int8_qk=True, int8_via_fp16=False)
qd, cache = torch.randn(2, 8, 64, dtype=torch.bfloat16), torch.randn(10, 16, 2, 64, dtype=torch.bfloat16)
tables, lens = torch.zeros(2, 40, dtype=torch.int32), torch.tensor([5, 600], dtype=torch.int32)
pd._paged_decode_triton(qd, cache, cache, tables, lens, 0.1, splits=4)
"""


@pytest.mark.slow
def test_attention_kernels_compile_for_sm80():
    import os
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this triton build ships no ptxas")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _CUDA_COMPILE_SCRIPT, "80"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("_flash_attention_forward_kernel") == 2
    assert "_paged_decode_reduce_kernel" in result.stdout


def _attention_module():
    import importlib

    return importlib.import_module("tessel.kernels.flash_attention")


@pytest.mark.parametrize(
    "tile", _attention_module().ATTENTION_CONFIGS, ids=lambda t: f"m{t.block_m}n{t.block_n}"
)
def test_every_autotune_candidate_is_correct(monkeypatch, triton_backend, tile):
    """The tuner may pick any candidate on a GPU: each must give the right answer (here with a
    prefix, a ragged key tail and D = 80 padded to 128)."""
    monkeypatch.setattr(_attention_module(), "_heuristic_tile", lambda *args: tile)
    q, k, v = make_qkv((1, 2, 1, 45, 150, 80), torch.float16)
    out = flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), reference(q, k, v, True), atol=2e-3, rtol=2e-3)


def test_no_queries(backend):
    q, k, v = make_qkv((1, 2, 1, 0, 4, 16), torch.float32)
    assert flash_attention(q, k, v).shape == (1, 2, 0, 16)
    assert flash_attention_int8(q, k, v).shape == (1, 2, 0, 16)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 2),
    n_kv=st.integers(1, 2),
    group=st.integers(1, 3),
    seq_q=st.integers(1, 40),
    prefix=st.integers(0, 70),
    head_dim=st.sampled_from([16, 24, 40, 64, 72, 96, 112, 128]),
    causal=st.booleans(),
    dtype_index=st.integers(0, 2),
)
def test_random_shapes(backend, batch, n_kv, group, seq_q, prefix, head_dim, causal, dtype_index):
    """Random GQA groups, chunk lengths, prefixes and head dims (odd multiples of 8 included)."""
    dtype, atol, rtol = TOLERANCES[dtype_index]
    q, k, v = make_qkv((batch, n_kv * group, n_kv, seq_q, seq_q + prefix, head_dim), dtype)
    out = flash_attention(q, k, v, causal=causal)
    torch.testing.assert_close(out.double(), reference(q, k, v, causal), atol=atol, rtol=rtol)
