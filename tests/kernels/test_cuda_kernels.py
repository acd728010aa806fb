"""Every Triton kernel compiled for a CUDA GPU, against float64 oracles computed on the CPU.

The other kernel tests run the same kernels in Triton's interpreter on CPU tensors; this file
checks what the interpreter cannot: that each kernel compiles for the GPU and gives the same
numbers there (autotuned configs, tensor-core dots, the int8 dot, flash-decoding's splits).
Skipped where PyTorch sees no GPU; run there with TRITON_INTERPRET=0.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tessel import kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = "cuda"
# (dtype, atol, rtol) against float64 for O(1) outputs: fp32 to a few ulps of its sums, fp16 and
# bf16 to about two ulps of their own.
FLOATS = [(torch.float32, 1e-4, 1e-4), (torch.float16, 3e-3, 3e-3), (torch.bfloat16, 3e-2, 2e-2)]
FLOAT_IDS = ["fp32", "fp16", "bf16"]


@pytest.fixture(autouse=True)
def _compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "run the CUDA tests with TRITON_INTERPRET=0"
    monkeypatch.setenv("TESSEL_KERNEL_BACKEND", "triton")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
    assert got.is_cuda
    torch.testing.assert_close(got.double().cpu(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("hidden", [64, 576, 4096, 5000])
def test_rms_norm_with_residual(dtype, atol, rtol, hidden: int) -> None:
    x, r, w = randn(37, hidden), randn(37, hidden, seed=1), randn(hidden, seed=2)
    x, r = x.to(dtype).double(), r.to(dtype).double()  # the oracle sees the rounded inputs
    w = w.to(dtype).double()
    s = x + r
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    out, new_residual = kernels.rms_norm(x.to(dtype).cuda(), w.to(dtype).cuda(), 1e-6, r.to(dtype).cuda())
    close(new_residual, s, atol, rtol)
    close(out, want, atol * 4, rtol * 4)  # w up to ~4 in magnitude


@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOATS, ids=FLOAT_IDS)
def test_layer_norm(dtype, atol, rtol) -> None:
    x, w, b = randn(19, 1000).to(dtype).double(), randn(1000, seed=1), randn(1000, seed=2)
    w, b = w.to(dtype).double(), b.to(dtype).double()
    want = F.layer_norm(x, (1000,), w, b, 1e-5)
    out = kernels.layer_norm(x.to(dtype).cuda(), w.to(dtype).cuda(), b.to(dtype).cuda(), 1e-5)
    close(out, want, atol * 4, rtol * 4)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOATS, ids=FLOAT_IDS)
def test_rope_with_partial_rotary_dim(dtype, atol, rtol) -> None:
    t, hq, hkv, d, rot = 23, 8, 2, 64, 32
    q, k = randn(t, hq, d).to(dtype).double(), randn(t, hkv, d, seed=1).to(dtype).double()
    positions = torch.randperm(500, generator=torch.Generator().manual_seed(3))[:t]
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = torch.arange(500, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = freqs.cos(), freqs.sin()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        c = torch.cat((cos[positions], cos[positions]), -1)[:, None]
        s = torch.cat((sin[positions], sin[positions]), -1)[:, None]
        head, tail = x[..., :rot], x[..., rot:]
        half = torch.cat((-head[..., rot // 2 :], head[..., : rot // 2]), -1)
        return torch.cat((head * c + half * s, tail), -1)

    q_out, k_out = kernels.rope(
        q.to(dtype).cuda(), k.to(dtype).cuda(), positions.cuda(), cos.float().cuda(), sin.float().cuda()
    )
    close(q_out, rotate(q), atol * 4, rtol * 4)
    close(k_out, rotate(k), atol * 4, rtol * 4)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOATS, ids=FLOAT_IDS)
def test_silu_and_mul(dtype, atol, rtol) -> None:
    x = randn(33, 2 * 1536).to(dtype).double()
    want = F.silu(x[:, :1536]) * x[:, 1536:]
    close(kernels.silu_and_mul(x.to(dtype).cuda()), want, atol * 4, rtol * 4)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOATS, ids=FLOAT_IDS)
def test_softmax_masked_and_log_softmax(dtype, atol, rtol) -> None:
    x = (randn(17, 3000) * 4).to(dtype).double()
    mask = torch.rand(17, 3000, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[3] = False  # a fully masked row gives zeros
    want = torch.softmax(x.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    close(kernels.softmax(x.to(dtype).cuda(), mask.cuda()), want, atol, rtol)
    close(kernels.log_softmax(x.to(dtype).cuda()), torch.log_softmax(x, -1), atol * 20, rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8, torch.bool])
def test_transpose_of_a_strided_view(dtype) -> None:
    x = (randn(300, 700) * 50).to(dtype)[::2, 5:]
    assert torch.equal(kernels.transpose(x.cuda()).cpu(), x.t().contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_per_token_matches_the_formula(dtype) -> None:
    x = (randn(65, 4096) * 3).to(dtype)
    x[7] = 0  # a zero row: codes 0
    q, scale = kernels.quantize_per_token(x.cuda())
    want_scale = x.double().abs().amax(-1).clamp(min=1e-8) / 127  # the kernel's float32 rounding aside
    nonzero = x.abs().amax(-1) > 0
    torch.testing.assert_close(scale.double().cpu()[nonzero], want_scale[nonzero], rtol=1e-6, atol=0)
    want_q = torch.round(x.double() / scale.double().cpu()[:, None]).clamp(-127, 127)
    assert (q.cpu().double() - want_q).abs().max() <= 1  # a tie may round either way in float32


@pytest.mark.parametrize(("m", "n", "k"), [(1, 576, 576), (7, 1536, 576), (256, 4096, 4096), (33, 100, 72)])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int8_gemm_is_the_exact_integer_product_scaled(m: int, n: int, k: int, out_dtype) -> None:
    g = torch.Generator().manual_seed(m + n)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    a_scale, w_scale = torch.rand(m, generator=g) / 400 + 1e-4, torch.rand(n, generator=g) / 400 + 1e-4
    bias = torch.randn(n, generator=g)
    exact = (a.double() @ w.double().t()) * a_scale.double()[:, None] * w_scale.double()[None] + bias.double()
    out = kernels.int8_gemm(a.cuda(), w.cuda(), a_scale.cuda(), w_scale.cuda(), bias.cuda(), out_dtype)
    assert out.dtype == out_dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[out_dtype]
    close(out, exact, tol * float(exact.abs().max()), tol)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 576, 576), (9, 1536, 576), (128, 4096, 4096)])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOATS, ids=FLOAT_IDS)
def test_w8a16_gemm_and_linear(m: int, n: int, k: int, dtype, atol, rtol) -> None:
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=g) / k**0.5).to(dtype)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w_scale, bias = torch.rand(n, generator=g) / 100, torch.randn(n, generator=g).to(dtype)
    want = x.double() @ (w.double() * w_scale.double()[:, None]).t() + bias.double()
    out = kernels.w8a16_gemm(x.cuda(), w.cuda(), w_scale.cuda(), bias.cuda())
    close(out, want, atol * 4, rtol * 4)
    weight = (torch.randn(n, k, generator=g) / 2).to(dtype)
    want = x.double() @ weight.double().t()
    close(kernels.linear(x.cuda(), weight.cuda()), want, atol * 4, rtol * 4)


def _sdpa64(q, k, v, causal: bool, scale: float | None = None) -> torch.Tensor:
    """float64 SDPA with GQA and the bottom-right causal mask (Sq <= Sk)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    sq, sk = q.shape[2], k.shape[2]
    mask = None
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize(
    ("hq", "hkv", "sq", "sk", "d", "causal"),
    [
        (8, 2, 300, 300, 64, True),
        (4, 4, 17, 513, 128, True),
        (6, 1, 129, 129, 80, False),
        (2, 2, 1, 40, 32, True),
    ],
)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOATS, ids=FLOAT_IDS)
def test_flash_attention_against_float64_sdpa(hq, hkv, sq, sk, d, causal, dtype, atol, rtol) -> None:
    q, k, v = (
        randn(2, hq, sq, d).to(dtype),
        randn(2, hkv, sk, d, seed=1).to(dtype),
        randn(2, hkv, sk, d, seed=2),
    )
    v = v.to(dtype)
    want = _sdpa64(q.double(), k.double(), v.double(), causal)
    close(kernels.flash_attention(q.cuda(), k.cuda(), v.cuda(), causal=causal), want, atol * 2, rtol * 2)


def test_flash_attention_int8_qk_stays_near_float64() -> None:
    q, k, v = randn(1, 8, 256, 64).half(), randn(1, 2, 256, 64, seed=1).half(), randn(1, 2, 256, 64, seed=2)
    want = _sdpa64(q.double(), k.double(), v.half().double(), True)
    out = kernels.flash_attention_int8(q.cuda(), k.cuda(), v.half().cuda(), causal=True)
    assert float((out.double().cpu() - want).abs().max()) < 3e-2  # Q K^T in int8: ~1% per score


@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "block", "lens"), [(9, 3, 64, 16, [1, 70, 2048, 333]), (4, 1, 128, 8, [5000])]
)
def test_paged_decode_with_context_splits(dtype, atol, rtol, hq, hkv, d, block, lens) -> None:
    """Long contexts and few sequences: flash-decoding splits the context across programs."""
    blocks = [-(-n // block) for n in lens]
    pool = sum(blocks) + 3
    perm = torch.randperm(pool, generator=torch.Generator().manual_seed(4))
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    start = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = perm[start : start + nb].int()
        start += nb
    k_cache, v_cache = randn(pool, block, hkv, d).to(dtype), randn(pool, block, hkv, d, seed=1).to(dtype)
    q = randn(len(lens), hq, d, seed=2).to(dtype)
    want = []
    for b, n in enumerate(lens):
        slots = tables[b].long()[:, None] * block + torch.arange(block)
        idx = slots.flatten()[:n]
        ks = k_cache.double().flatten(0, 1)[idx].transpose(0, 1)[None]
        vs = v_cache.double().flatten(0, 1)[idx].transpose(0, 1)[None]
        want.append(_sdpa64(q[b].double()[None, :, None], ks, vs, False)[0, :, 0])
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = kernels.paged_decode_attention(
        q.cuda(), k_cache.cuda(), v_cache.cuda(), tables.cuda(), lens_t.cuda()
    )
    close(out, torch.stack(want), atol * 2, rtol * 2)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), FLOATS, ids=FLOAT_IDS)
def test_conv2d_strided_padded_grouped(dtype, atol, rtol) -> None:
    x, w = randn(2, 16, 21, 19).to(dtype), (randn(32, 8, 3, 3, seed=1) / 6).to(dtype)
    b = randn(32, seed=2).to(dtype)
    want = F.conv2d(x.double(), w.double(), b.double(), stride=2, padding=1, groups=2)
    out = kernels.conv2d(x.cuda(), w.cuda(), b.to(dtype).cuda(), stride=2, padding=1, groups=2)
    close(out, want, atol * 8, rtol * 8)
