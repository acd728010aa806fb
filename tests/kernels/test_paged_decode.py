"""paged_decode_attention against float64 SDPA over each sequence's gathered K/V, on both paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessel.kernels import paged_decode_attention

# (dtype, atol, rtol) against float64 on the same inputs: fp32 dots exact, P rounded to dtype for
# P @ V and O rounded once, so about two ulps of the dtype on outputs of size <= 1.
TOLERANCES = [
    (torch.float32, 2e-5, 1e-4),
    (torch.float16, 2e-3, 2e-3),
    (torch.bfloat16, 2e-2, 1.6e-2),
]
# (q heads, kv heads, head dim, block size, context lengths): GQA, MHA and MQA, block sizes 16
# and odd ones, ragged lengths including 1 and exact block multiples.
CASES = [
    (8, 2, 64, 16, [1, 50, 96, 17]),
    (4, 4, 80, 7, [13, 1, 64]),
    (6, 1, 32, 12, [100, 24]),
    (2, 2, 128, 16, [16, 130]),
    (4, 2, 16, 1, [9, 3]),
]


def make_paged(n_q, n_kv, head_dim, block_size, lens, dtype, spare_blocks=5, pad_value=0):
    """Caches with the blocks of all sequences shuffled across the pool, tables padded with pad_value."""
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks)
    max_blocks = max(blocks_per_seq) + 2
    tables = torch.full((len(lens), max_blocks), pad_value, dtype=torch.int32)
    start = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = perm[start : start + nb].to(torch.int32)
        start += nb
    k_cache = torch.randn(num_blocks, block_size, n_kv, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, n_kv, head_dim).to(dtype)
    q = torch.randn(len(lens), n_q, head_dim).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def reference(q, k_cache, v_cache, tables, lens, scale=None):
    """Per sequence: walk its tokens one by one through the block table, then float64 SDPA."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    outs = []
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            outs.append(torch.zeros(q.shape[1], q.shape[2], dtype=torch.float64))
            continue
        idx = [(int(tables[b, t // block_size]), t % block_size) for t in range(n)]
        k = torch.stack([k_cache[blk, slot] for blk, slot in idx]).double()  # [n, Hkv, D]
        v = torch.stack([v_cache[blk, slot] for blk, slot in idx]).double()
        k = k.transpose(0, 1).repeat_interleave(group, 0)  # [Hq, n, D]
        v = v.transpose(0, 1).repeat_interleave(group, 0)
        out = F.scaled_dot_product_attention(q[b].double()[:, None, :], k, v, scale=scale)
        outs.append(out[:, 0, :])
    return torch.stack(outs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}")
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
def test_paged_decode_matches_float64(backend, case, dtype, atol, rtol):
    q, k_cache, v_cache, tables, lens = make_paged(*case, dtype)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(
        out.double(), reference(q, k_cache, v_cache, tables, lens), atol=atol, rtol=rtol
    )


def test_table_padding_past_the_end_is_ignored(backend):
    """Entries past a sequence's last block may be -1 (or anything): never read."""
    q, k_cache, v_cache, tables, lens = make_paged(4, 2, 32, 16, [5, 40, 33], torch.float32, pad_value=-1)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale=0.2)
    ref = reference(q, k_cache, v_cache, tables, lens, scale=0.2)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


def test_empty_context_gives_zeros(backend):
    q, k_cache, v_cache, tables, lens = make_paged(4, 2, 32, 8, [0, 11], torch.float32)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(
        out.double(), reference(q, k_cache, v_cache, tables, lens), atol=2e-5, rtol=1e-4
    )


def test_strided_query_from_a_fused_projection(backend):
    q_full, k_cache, v_cache, tables, lens = make_paged(8, 2, 64, 16, [30, 7], torch.float16)
    q = torch.cat((q_full, torch.randn_like(q_full)), dim=1)[:, :8]  # batch stride 2 * Hq * D
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(
        out.double(), reference(q, k_cache, v_cache, tables, lens), atol=2e-3, rtol=2e-3
    )


def test_decode_equals_the_last_row_of_causal_flash_attention(torch_backend):
    """The decode token attends to the whole context, as the last query row of a causal prefill."""
    from tessel.kernels import flash_attention

    q, k_cache, v_cache, tables, lens = make_paged(4, 2, 32, 16, [37], torch.float32, spare_blocks=0)
    blocks = tables[0, :3].long()
    k = k_cache[blocks].flatten(0, 1)[:37].transpose(0, 1)[None]  # [1, Hkv, 37, D]
    v = v_cache[blocks].flatten(0, 1)[:37].transpose(0, 1)[None]
    full_q = torch.randn(1, 4, 37, 32)
    full_q[0, :, -1] = q[0]
    expected = flash_attention(full_q, k, v, causal=True)[0, :, -1]
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_rejected():
    q, k_cache, v_cache, tables, lens = make_paged(3, 2, 16, 4, [3], torch.float32)
    with pytest.raises(ValueError):
        paged_decode_attention(q, k_cache, v_cache, tables, lens)
    q, k_cache, v_cache, tables, lens = make_paged(4, 2, 16, 4, [3], torch.float32)
    with pytest.raises(ValueError):
        paged_decode_attention(q, k_cache, v_cache, tables[:, :, None], lens)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q.half(), k_cache, v_cache, tables, lens)


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("dtype, atol, rtol", [TOLERANCES[0], TOLERANCES[2]])
def test_split_context_flash_decoding(triton_backend, splits, dtype, atol, rtol):
    """The split-and-reduce path (used on GPUs the batch does not fill): splits past a short
    sequence's end hold nothing, and an empty context still gives zeros."""
    from tessel.kernels.paged_decode import _paged_decode_triton

    q, k_cache, v_cache, tables, lens = make_paged(8, 2, 64, 16, [1, 150, 0, 64, 333], dtype)
    out = _paged_decode_triton(q, k_cache, v_cache, tables, lens, 0.125, splits=splits)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    ref = reference(q, k_cache, v_cache, tables, lens, scale=0.125)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


def test_split_heuristic(monkeypatch):
    import importlib

    module = importlib.import_module("tessel.kernels.paged_decode")
    monkeypatch.setattr(module, "_multiprocessor_count", lambda index: 132)  # an H100
    cuda = torch.device("cuda", 0)
    assert module.num_splits(1, 8, 8192, torch.device("cpu")) == 1
    assert module.num_splits(64, 8, 8192, cuda) == 1  # 512 programs already fill 132 SMs
    assert module.num_splits(1, 8, 200, cuda) == 1  # too short to split
    assert module.num_splits(1, 8, 8192, cuda) == 32  # 264 / 8 = 33 wanted, 8192 / 256 = 32 allowed
    assert module.num_splits(1, 1, 1 << 20, cuda) == module.MAX_SPLITS


def test_no_sequences(backend):
    cache = torch.randn(3, 4, 1, 16)
    tables, lens = torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    assert paged_decode_attention(torch.randn(0, 2, 16), cache, cache, tables, lens).shape == (0, 2, 16)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_kv=st.integers(1, 3),
    group=st.integers(1, 4),
    head_dim=st.sampled_from([16, 40, 64, 80, 128]),
    block_size=st.sampled_from([1, 3, 8, 16, 32]),
    lens=st.lists(st.integers(0, 150), min_size=1, max_size=4),
    dtype_index=st.integers(0, 2),
)
def test_random_batches(backend, n_kv, group, head_dim, block_size, lens, dtype_index):
    dtype, atol, rtol = TOLERANCES[dtype_index]
    q, k_cache, v_cache, tables, lens_t = make_paged(n_kv * group, n_kv, head_dim, block_size, lens, dtype)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens_t)
    ref = reference(q, k_cache, v_cache, tables, lens_t)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


def _decode_module():
    import importlib

    return importlib.import_module("tessel.kernels.paged_decode")


@pytest.mark.parametrize(
    "tile", _decode_module().PAGED_DECODE_CONFIGS, ids=lambda t: f"n{t.block_n}w{t.num_warps}s{t.num_stages}"
)
@pytest.mark.parametrize("splits", [1, 3])
def test_every_autotune_candidate_is_correct(monkeypatch, triton_backend, tile, splits):
    """The tuner may pick any candidate on a GPU: each must give the right answer."""
    module = _decode_module()
    monkeypatch.setattr(module, "_DEFAULT_TILE", tile)
    q, k_cache, v_cache, tables, lens = make_paged(6, 2, 80, 12, [1, 150, 37], torch.float16)
    out = module._paged_decode_triton(q, k_cache, v_cache, tables, lens, 0.1, splits=splits)
    ref = reference(q, k_cache, v_cache, tables, lens, scale=0.1)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("form", ["batched", "loop"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}q{c[1]}kv-d{c[2]}-bs{c[3]}")
@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
def test_both_cpu_forms_match_float64(torch_backend, monkeypatch, form, case, dtype, atol, rtol):
    """The short-context batched form and the per-sequence loop, each forced on every case."""
    monkeypatch.setattr(_decode_module(), "batched_fits", lambda *args: form == "batched")
    q, k_cache, v_cache, tables, lens = make_paged(*case, dtype, pad_value=-1)
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(
        out.double(), reference(q, k_cache, v_cache, tables, lens), atol=atol, rtol=rtol
    )


def test_batched_form_never_reads_past_a_context(torch_backend, monkeypatch):
    """Every cache slot outside the rows' contexts holds NaN (the rest of a last block, the other
    blocks, block 0): the output stays finite, and a row without context gets zeros."""
    monkeypatch.setattr(_decode_module(), "batched_fits", lambda *args: True)
    q, k_cache, v_cache, tables, lens = make_paged(6, 2, 32, 8, [13, 0, 3, 21], torch.float32, pad_value=-1)
    valid = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        for t in range(n):
            valid[tables[b, t // 8], t % 8] = True
    k_cache[~valid] = float("nan")
    v_cache[~valid] = float("nan")
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens)
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))
    ref = reference(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


def test_a_gather_built_once_serves_every_layer(torch_backend):
    """The engine builds `decode_gather` once per step and passes it to each layer's call."""
    module = _decode_module()
    q, k_cache, v_cache, tables, lens = make_paged(8, 2, 64, 16, [1, 50, 96, 17], torch.float32)
    gather = module.decode_gather(tables, lens, k_cache)
    assert gather is not None and gather.tokens == 96 and gather.empty_rows is None
    for _ in range(2):  # another layer: other caches and queries, the same gather
        k2, v2, q2 = torch.randn_like(k_cache), torch.randn_like(v_cache), torch.randn_like(q)
        out = paged_decode_attention(q2, k2, v2, tables, lens, gather=gather)
        torch.testing.assert_close(out.double(), reference(q2, k2, v2, tables, lens), atol=2e-5, rtol=1e-4)


def test_batched_form_is_taken_for_short_contexts_only():
    module = _decode_module()
    fits = module.batched_fits
    assert fits(32, 96, 3, 64, 4)  # SmolLM2's 3 kv heads of 64, 32 rows of <= 96 tokens: 2.25 MiB
    assert not fits(1, 96, 3, 64, 4)  # one row: nothing to batch
    assert not fits(4, 129, 3, 64, 4)  # a context past 128 tokens
    assert not fits(32, 112, 3, 64, 4)  # 2.6 MiB of K
    assert fits(64, 64, 3, 64, 2)  # float16 halves the bytes
    q, k_cache, v_cache, tables, lens = make_paged(4, 2, 16, 4, [5, 9], torch.float32)
    assert module.decode_gather(tables, lens, k_cache) is not None
    assert module.decode_gather(tables[:1], lens[:1], k_cache) is None
    strided = torch.randn(k_cache.shape[0], k_cache.shape[1], 4, 16)[:, :, :2]  # not contiguous
    assert module.decode_gather(tables, lens, strided) is None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    block_size=st.sampled_from([1, 3, 8, 16]),
    lens=st.lists(st.integers(0, 60), min_size=2, max_size=6),
    pad_value=st.sampled_from([-1, 0, 10**6]),
)
def test_batched_form_on_random_rows(torch_backend, monkeypatch, n_kv, group, block_size, lens, pad_value):
    """Forced batched form: ragged rows (empty ones too), table padding that is -1, a real block or
    far out of range; the padding must never be read."""
    monkeypatch.setattr(_decode_module(), "batched_fits", lambda *args: True)
    q, k_cache, v_cache, tables, lens_t = make_paged(
        n_kv * group, n_kv, 16, block_size, lens, torch.float32, pad_value=pad_value
    )
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens_t)
    torch.testing.assert_close(
        out.double(), reference(q, k_cache, v_cache, tables, lens_t), atol=2e-5, rtol=1e-4
    )
