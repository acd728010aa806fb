"""Paged attention (prefill chunks with a cached prefix, batched decode) against SDPA on
contiguous k/v, with scattered block tables and odd sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessel.layers.attention import Attention, AttentionMetadata, DecodeGroup, PrefillChunk


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Sq, Hq, D] = the last Sq positions of k/v [Sk, Hkv, D]; causal."""
    sq, sk, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1).transpose(0, 1).double()
    v = v.repeat_interleave(group, 1).transpose(0, 1).double()
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).double(), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).float()


@pytest.mark.parametrize("split_decodes", [False, True])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (3, 3, 8), (8, 1, 32)])
def test_mixed_decode_and_prefill_step_matches_sdpa(
    block_size, heads, kv_heads, head_dim, split_decodes
) -> None:
    g = torch.Generator().manual_seed(block_size * 100 + heads)
    # (tokens already cached, tokens computed this step): decodes first, then prefill chunks
    seqs = [(6, 1), (0, 1), (30, 1), (0, 13), (9, 5), (17, 2)]
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    free = torch.randperm(num_blocks, generator=g).tolist()
    attn = Attention(heads, head_dim, head_dim**-0.5, kv_heads)
    attn.k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    attn.v_cache = torch.zeros_like(attn.k_cache)
    full_k, full_v, tables = [], [], []
    for cached, n in seqs:
        total = cached + n
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table)
        k = torch.randn(total, kv_heads, head_dim, generator=g)
        v = torch.randn(total, kv_heads, head_dim, generator=g)
        for pos in range(cached):  # the prefix is already in the cache
            attn.k_cache[table[pos // block_size], pos % block_size] = k[pos]
            attn.v_cache[table[pos // block_size], pos % block_size] = v[pos]
        full_k.append(k)
        full_v.append(v)
    qs = [torch.randn(n, heads, head_dim, generator=g) for _, n in seqs]
    slots, prefills, offset = [], [], 0
    decodes = [i for i, (_, n) in enumerate(seqs) if n == 1]
    for i, (cached, n) in enumerate(seqs):
        slots += [tables[i][p // block_size] * block_size + p % block_size for p in range(cached, cached + n)]
        if n > 1:
            table = torch.tensor(tables[i]) if cached else None
            prefills.append(PrefillChunk(offset, n, cached + n, table))
        offset += n
    groups = []
    for rows in ([0, 1, 2], [0], [1, 2]) if split_decodes else ([0, 1, 2],):  # rows of `decodes`
        width = max(len(tables[decodes[r]]) for r in rows)
        padded = [tables[decodes[r]] + [7] * (width - len(tables[decodes[r]])) for r in rows]  # pad: ignored
        lens = [sum(seqs[decodes[r]]) for r in rows]
        groups.append(
            DecodeGroup(rows[0], rows[-1] + 1, torch.tensor(padded).int(), torch.tensor(lens).int())
        )
    groups = groups[1:] if split_decodes else groups
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=len(decodes),
        decode_groups=groups,
        prefills=prefills,
    )
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs, strict=True)])
    out = attn(torch.cat(qs), new_k, new_v, meta)
    expected = torch.cat([reference(q, k, v, attn.scale) for q, k, v in zip(qs, full_k, full_v, strict=True)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for i, (cached, n) in enumerate(seqs):  # and the new k/v landed in the cache
        for pos in range(cached + n):
            slot = tables[i][pos // block_size], pos % block_size
            assert torch.equal(attn.k_cache[slot], full_k[i][pos])
            assert torch.equal(attn.v_cache[slot], full_v[i][pos])
