"""Attention over the paged KV cache: prefill (with a cached prefix) and batched decode.

The model runner flattens a step's tokens: first one token per decoding sequence, then the
chunks of the sequences being prefilled. Each layer writes its new k/v into the cache through
`slot_mapping` (one `index_copy_`), runs `tessel.paged_decode_attention` over the decode
rows in one call, and `tessel.flash_attention` per prefill chunk (bottom-right causal, so
a chunk attends to its cached prefix too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
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

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
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
