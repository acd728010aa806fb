"""Attention over the paged KV cache: prefill (with a cached prefix) and batched decode.

The model runner flattens a step's tokens: first one token per decoding sequence, then the
chunks of the sequences being prefilled. Each layer writes its new k/v into the cache through
`slot_mapping` (one `index_copy_`), runs `tessel.paged_decode_attention` over the decode
rows in one call, and `tessel.flash_attention` per prefill chunk (bottom-right causal, so
a chunk attends to its cached prefix too).

With a sliding `window` W (Mistral, Phi-3, Gemma 3's local layers) a query at position p attends
only to keys at positions in (p - W, p], as transformers' sliding-window mask does: decode rows read
only the blocks that hold their window, prefill chunks take a banded causal mask over the keys any
of their queries can see. The cache keeps every token (the block manager frees nothing early).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tessel.kernels import flash_attention, paged_decode_attention
from tessel.kernels.paged_decode import DecodeGather


@dataclass(slots=True)
class PrefillChunk:
    """Tokens [start, start + num_tokens) of the flat batch; the sequence has `context_len` tokens
    of k/v after this step (cached prefix + this chunk), stored in the blocks `block_table`."""

    start: int
    num_tokens: int
    context_len: int
    block_table: torch.Tensor | None = None  # int64 [num_blocks]; None when nothing is cached

    @property
    def has_prefix(self) -> bool:
        return self.context_len > self.num_tokens


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows [start, end) of the flat batch: one `paged_decode_attention` call."""

    start: int
    end: int
    block_tables: torch.Tensor  # int32 [end - start, max_blocks of the group]
    context_lens: torch.Tensor  # int32 [end - start]
    gather: DecodeGather | None = None  # the CPU batched form's gather, built once per step


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: cache slot (block * block_size + offset) of each token
    num_decode_tokens: int = 0  # the first rows are decodes, one per sequence
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # cover rows [0, num_decode_tokens)
    prefills: list[PrefillChunk] = field(default_factory=list)


class Attention(nn.Module):
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. Caches: [num_blocks, block_size, Hkv, D]."""

    def __init__(
        self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, window: int | None = None
    ) -> None:
        super().__init__()
        self.window = window
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache.numel():
            self.store(k, v, meta.slot_mapping)
        if self.window is not None:
            return self._windowed(q, k, v, meta)
        groups = meta.decode_groups
        if len(groups) == 1 and groups[0].end == q.shape[0]:  # one decode group only: no extra copy
            g = groups[0]
            return paged_decode_attention(
                q, k_cache, v_cache, g.block_tables, g.context_lens, self.scale, g.gather
            )
        out = torch.empty_like(q)
        for g in groups:
            out[g.start : g.end] = paged_decode_attention(
                q[g.start : g.end], k_cache, v_cache, g.block_tables, g.context_lens, self.scale, g.gather
            )
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            if chunk.has_prefix:
                ks, vs = self._gather(k_cache, chunk), self._gather(v_cache, chunk)
            else:
                ks, vs = k[rows], v[rows]
            out[rows] = self._prefill(q[rows], ks, vs)
        return out

    def _windowed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """`forward` with the sliding window: each decode row over the blocks of its last W tokens,
        each prefill chunk over the keys its queries can see, under a banded causal mask."""
        out = torch.empty_like(q)
        for g in meta.decode_groups:
            block_size = self.k_cache.shape[1]
            for row, (table, length) in enumerate(zip(g.block_tables, g.context_lens.tolist(), strict=True)):
                start = max(0, length - self.window)
                first = start // block_size
                blocks = table[first : -(-length // block_size)].to(torch.int64)
                keys = slice(start - first * block_size, length - first * block_size)
                ks = self.k_cache.index_select(0, blocks).view(-1, self.num_kv_heads, self.head_dim)[keys]
                vs = self.v_cache.index_select(0, blocks).view(-1, self.num_kv_heads, self.head_dim)[keys]
                at = g.start + row
                out[at : at + 1] = self._band(q[at : at + 1], ks, vs, length - 1, start)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            first_query = chunk.context_len - chunk.num_tokens
            start = max(0, first_query - self.window + 1)
            if chunk.has_prefix:
                ks, vs = self._gather(self.k_cache, chunk)[start:], self._gather(self.v_cache, chunk)[start:]
            else:
                ks, vs = k[rows][start:], v[rows][start:]
            out[rows] = self._band(q[rows], ks, vs, first_query, start)
        return out

    def _band(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_query: int, first_key: int
    ) -> torch.Tensor:
        """q [Sq, Hq, D] at positions first_query.., k/v [Sk, Hkv, D] at first_key.. -> [Sq, Hq, D]:
        key j visible to query i iff 0 <= pos(i) - pos(j) < window."""
        q_pos = torch.arange(q.shape[0], device=q.device)[:, None] + first_query
        distance = q_pos - (torch.arange(k.shape[0], device=q.device)[None, :] + first_key)
        mask = (distance >= 0) & (distance < self.window)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).float(),
            k.transpose(0, 1).float(),
            v.transpose(0, 1).float(),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.transpose(0, 1).to(q.dtype)

    def store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write the step's k/v rows [T, Hkv, D] into the caches at their slots."""
        self.k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, k)
        self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, v)

    def _gather(self, cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        """The chunk's whole context from the cache: [context_len, Hkv, D]."""
        blocks = cache.index_select(0, chunk.block_table)
        return blocks.view(-1, self.num_kv_heads, self.head_dim)[: chunk.context_len]

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # flash_attention takes [B, H, S, D]; Sq < Sk aligns the causal mask bottom-right.
        out = flash_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            causal=True,
            scale=self.scale,
        )
        return out.squeeze(0).transpose(0, 1)
