"""Paged decode attention: one new query token per sequence against a block-paged KV cache.

Token t of sequence b lives in physical block `block_tables[b, t // block_size]` at slot
`t % block_size`. For query head h (kv head g = h // (Hq / Hkv)) and L = context_lens[b]:

    s_t    = scale * q[b, h] . k_cache[block(t), slot(t), g]        t < L
    out[b, h] = sum_t softmax(s)_t * v_cache[block(t), slot(t), g]

A sequence with L = 0 gets zeros. The Triton kernel runs one program per (sequence, kv head)
and handles the whole query-head group at once, so each K/V block is read once per group;
tokens are walked in tiles with an online softmax, for any block size. When those programs are
too few to fill the GPU (small batch, long context), the context is split across programs
(flash-decoding): split s returns its normalised partial output o_s and lse_s = log2 sum exp2,
and a second kernel combines out = sum_s 2^(lse_s) o_s / sum_s 2^(lse_s).

The PyTorch path (the engine's CPU decode) has two forms. With several rows of short contexts
(`batched_fits`: at most `BATCHED_MAX_TOKENS` tokens, `BATCHED_MAX_BYTES` of K) one token-level
gather builds every row's K/V padded to the longest context (padding repeats the row's first
token, so it is finite wherever the context is), then one `scaled_dot_product_attention` over
views of it (each kv head's query group a short query sequence), the padding masked out by a
-inf bias. It replaced two batched matmuls on a head-major copy, which ran slower on a Zen 4 CPU
(`benchmarks/decode_ab.py`; not measured on AVX2). The gather's
slot index (`decode_gather`) is the same for every layer of a step; the engine builds it once per
step. Otherwise the loop goes sequence by sequence: gather its used blocks, two matmuls. A
sequence's ~8 small ops cost tens of microseconds on a CPU, more than a short context's
arithmetic; past those limits the padded copy outgrows the core's cache and the loop wins
(`benchmarks/decode_ab.py --change batched-attention` measures it in the engine).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tessel.kernels import _utils
from tessel.kernels._utils import LOG2_E, dot_operand, interpreting, last_dim_contiguous, tl, triton
from tessel.kernels.autotune import Autotuner, TileConfig, bucket_m, cuda_bench, device_name, shape_key
from tessel.kernels.dispatch import use_triton

MIN_SPLIT_TOKENS = 256  # flash-decoding: a split shorter than this costs more in the reduce than it saves
MAX_SPLITS = 64
# CPU: a step's rows are batched up to this context and this size of the padded K copy (one cache).
BATCHED_MAX_TOKENS = 128
BATCHED_MAX_BYTES = 5 << 19  # 2.5 MiB


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        Q_ptr, q_batch_stride, q_head_stride,
        K_ptr, k_block_stride, k_slot_stride, k_head_stride,
        V_ptr, v_block_stride, v_slot_stride, v_head_stride,
        BT_ptr, bt_batch_stride,
        Lens_ptr,
        O_ptr, o_batch_stride, o_head_stride,
        PartO_ptr, po_batch_stride, po_head_stride, po_split_stride,
        PartL_ptr, pl_batch_stride, pl_head_stride,
        group_size, head_dim, tokens_per_split, qk_scale_log2,
        PAGE_SIZE: tl.constexpr,
        SPLIT: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        context_len = tl.load(Lens_ptr + b)
        lo = 0
        hi = context_len
        if SPLIT:  # this program covers tokens [lo, hi) of the context
            split = tl.program_id(2)
            lo = split * tokens_per_split
            hi = tl.minimum(context_len, lo + tokens_per_split)

        offs_g = tl.arange(0, BLOCK_G)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < head_dim
        heads = g * group_size + offs_g
        q_mask = (offs_g[:, None] < group_size) & d_mask[None, :]
        q_ptrs = Q_ptr + b * q_batch_stride + heads[:, None] * q_head_stride + offs_d[None, :]
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        for start_n in range(lo, hi, BLOCK_N):
            tok = start_n + offs_n
            tok_mask = tok < hi
            block = tl.load(BT_ptr + b * bt_batch_stride + tok // PAGE_SIZE, mask=tok_mask, other=0)
            block = block.to(tl.int64)
            slot = (tok % PAGE_SIZE).to(tl.int64)
            kv_mask = tok_mask[:, None] & d_mask[None, :]
            k_ptrs = K_ptr + block[:, None] * k_block_stride + slot[:, None] * k_slot_stride
            k = tl.load(k_ptrs + g * k_head_stride + offs_d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(
                dot_operand(q, UPCAST_DOT),
                dot_operand(tl.trans(k), UPCAST_DOT),
                input_precision=DOT_PRECISION,
            )
            s = s * qk_scale_log2
            s = tl.where(tok_mask[None, :], s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a valid token
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_ptrs = V_ptr + block[:, None] * v_block_stride + slot[:, None] * v_slot_stride
            v = tl.load(v_ptrs + g * v_head_stride + offs_d[None, :], mask=kv_mask, other=0.0)
            p = dot_operand(p.to(v.dtype), UPCAST_DOT)
            acc = tl.dot(p, dot_operand(v, UPCAST_DOT), acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no tokens (context_len 0, or a split past the end)
        out = acc / l_safe[:, None]
        if SPLIT:
            # partial output and its log2-sum-exp2; the reduce kernel weighs splits by exp2(lse)
            po_ptrs = PartO_ptr + b * po_batch_stride + heads[:, None] * po_head_stride
            tl.store(po_ptrs + split * po_split_stride + offs_d[None, :], out, mask=q_mask)
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            pl_ptrs = PartL_ptr + b * pl_batch_stride + heads * pl_head_stride + split
            tl.store(pl_ptrs, lse, mask=offs_g < group_size)
        else:
            o_ptrs = O_ptr + b * o_batch_stride + heads[:, None] * o_head_stride + offs_d[None, :]
            tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=q_mask)

    @triton.jit
    def _paged_decode_reduce_kernel(
        PartO_ptr, po_batch_stride, po_head_stride, po_split_stride,
        PartL_ptr, pl_batch_stride, pl_head_stride,
        O_ptr, o_batch_stride, o_head_stride,
        num_splits, head_dim,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """out = sum_s w_s o_s / sum_s w_s with w_s = exp2(lse_s - max lse): the softmax over the
        whole context, assembled from the per-split softmaxes."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < num_splits
        lse = tl.load(
            PartL_ptr + b * pl_batch_stride + h * pl_head_stride + offs_s, mask=s_mask, other=float("-inf")
        )
        m = tl.max(lse, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m_safe)
        po_ptrs = PartO_ptr + b * po_batch_stride + h * po_head_stride + offs_s[:, None] * po_split_stride
        o = tl.load(po_ptrs + offs_d[None, :], mask=s_mask[:, None] & (offs_d[None, :] < head_dim), other=0.0)
        total = tl.sum(w, axis=0)
        out = tl.sum(w[:, None] * o, axis=0) / tl.where(total == 0.0, 1.0, total)
        o_ptrs = O_ptr + b * o_batch_stride + h * o_head_stride + offs_d
        tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=offs_d < head_dim)


def _check(q, k_cache, v_cache, block_tables, context_lens) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "paged_decode_attention expects q [B,Hq,D], caches [num_blocks,block_size,Hkv,D]; got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"q and the caches must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not match cache {tuple(k_cache.shape)} (head dim, GQA)")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        raise ValueError(
            f"block_tables must be [B, max_blocks] and context_lens [B] for B={q.shape[0]}; got "
            f"{tuple(block_tables.shape)}, {tuple(context_lens.shape)}"
        )


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits(batch: int, n_kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """How many context splits (flash-decoding) a launch uses: 1 when (sequence, kv head) programs
    already fill the GPU, else enough splits for ~2 programs per SM, each split >= MIN_SPLIT_TOKENS.

    `max_tokens` is the table capacity (max_blocks * block_size), so no device sync is needed."""
    if device.type != "cuda" or max_tokens <= MIN_SPLIT_TOKENS:
        return 1
    programs = batch * n_kv_heads
    target = 2 * _multiprocessor_count(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    if programs >= target:
        return 1
    return max(1, min(MAX_SPLITS, -(-target // programs), -(-max_tokens // MIN_SPLIT_TOKENS)))


def _decode_tile(block_n: int, num_warps: int, num_stages: int) -> TileConfig:
    # only block_n (tokens per tile), warps and stages are tuned; the query-head tile is the group
    return TileConfig(16, block_n, 16, group_m=1, num_warps=num_warps, num_stages=num_stages)


# CUDA candidates, (BLOCK_N tokens, warps, stages): the kernel streams K/V, so the choice is
# about bytes in flight per SM. Untuned: 64 tokens, 4 warps, 3 stages.
PAGED_DECODE_CONFIGS: tuple[TileConfig, ...] = tuple(
    _decode_tile(*c)
    for c in (
        (32, 2, 2),
        (32, 4, 3),
        (64, 4, 2),
        (64, 4, 3),
        (64, 8, 3),
        (128, 4, 3),
        (128, 8, 3),
        (128, 8, 4),
    )
)
_DEFAULT_TILE = _decode_tile(64, 4, 3)
_TUNER = Autotuner("paged_decode", PAGED_DECODE_CONFIGS, default=_DEFAULT_TILE)


def _paged_decode_triton(
    q, k_cache, v_cache, block_tables, context_lens, scale, splits: int | None = None
) -> torch.Tensor:
    batch, n_q_heads, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = n_q_heads // n_kv_heads
    q, k_cache, v_cache, block_tables = (last_dim_contiguous(t) for t in (q, k_cache, v_cache, block_tables))
    context_lens = context_lens.contiguous()
    out = _utils.empty_output(q.shape, q.dtype, q.device)
    if batch == 0:
        return out
    max_tokens = block_tables.shape[1] * block_size
    if splits is None:
        splits = num_splits(batch, n_kv_heads, max_tokens, q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if splits > 1:
        part_o = _utils.empty_output((batch, n_q_heads, splits, head_dim), torch.float32, q.device)
        part_l = _utils.empty_output((batch, n_q_heads, splits), torch.float32, q.device)
        po_strides, pl_strides = part_o.stride()[:3], part_l.stride()[:2]
    else:
        part_o, part_l = out, out  # never touched when SPLIT=False
        po_strides, pl_strides = (0, 0, 0), (0, 0)

    def launch(tile: TileConfig) -> None:
        tokens_per_split = -(-max_tokens // (splits * tile.block_n)) * tile.block_n
        _paged_decode_kernel[(batch, n_kv_heads, splits)](
            q, q.stride(0), q.stride(1),
            k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables, block_tables.stride(0),
            context_lens,
            out, out.stride(0), out.stride(1),
            part_o, *po_strides,
            part_l, *pl_strides,
            group, head_dim, tokens_per_split, scale * LOG2_E,
            PAGE_SIZE=block_size,
            SPLIT=splits > 1,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # None: the target default
            UPCAST_DOT=q.dtype == torch.bfloat16 and interpreting(),
            BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs M >= 16 in the interpreter
            BLOCK_N=tile.block_n,
            BLOCK_D=block_d,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )  # fmt: skip
        if splits > 1:
            _paged_decode_reduce_kernel[(batch, n_q_heads)](
                part_o, *po_strides,
                part_l, *pl_strides,
                out, out.stride(0), out.stride(1),
                splits, head_dim,
                BLOCK_S=triton.next_power_of_2(splits),
                BLOCK_D=block_d,
                num_warps=4,
            )  # fmt: skip

    tile = _DEFAULT_TILE
    if q.is_cuda and not interpreting():
        key = shape_key(
            d=head_dim, dtype=str(q.dtype).removeprefix("torch."), group=group, page=block_size,
            b=bucket_m(batch), hkv=n_kv_heads, cap=bucket_m(max_tokens), splits=splits,
        )  # fmt: skip
        tile = _TUNER.pick(key, cuda_bench(launch), device_name(q.device))
    launch(tile)
    return out


def batched_fits(batch: int, tokens: int, n_kv_heads: int, head_dim: int, itemsize: int) -> bool:
    """Whether the CPU path batches a step: more than one row, short contexts."""
    k_bytes = batch * tokens * n_kv_heads * head_dim * itemsize
    return batch > 1 and tokens <= BATCHED_MAX_TOKENS and k_bytes <= BATCHED_MAX_BYTES


@dataclass(frozen=True, slots=True)
class DecodeGather:
    """Where the batched CPU form reads a step's K/V: row b, token t < tokens."""

    slots: torch.Tensor  # int64 [B * tokens]: cache slot (block * block_size + offset) of each
    pad_bias: torch.Tensor  # float32 [B, 1, 1, tokens]: 0 on a context's tokens, -inf past it
    empty_rows: torch.Tensor | None  # bool [B]: rows with no context (their output is 0); None: none
    tokens: int  # the longest context


def decode_gather(
    block_tables: torch.Tensor, context_lens: torch.Tensor, k_cache: torch.Tensor
) -> DecodeGather | None:
    """The batched CPU form's gather for these rows, or None where the loop runs them instead."""
    lens = context_lens.tolist()
    block_size, n_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    tokens = max(lens, default=0)
    if k_cache.is_cuda or not k_cache.is_contiguous():
        return None
    if not batched_fits(len(lens), tokens, n_kv_heads, head_dim, k_cache.element_size()):
        return None
    # in numpy: a dozen small torch ops cost more than the step's attention at small shapes
    lens_col = context_lens.numpy().astype(np.int64)[:, None]
    positions = np.arange(tokens)
    valid = positions < lens_col  # [B, tokens]
    starts = block_tables.numpy()[:, : -(-tokens // block_size)].astype(np.int64) * block_size
    slots = starts[:, positions // block_size] + positions % block_size
    # a padded token reads the row's first one; a row without context has no block to read (its
    # table may hold anything): slot 0, output 0
    first = np.where(lens_col > 0, starts[:, :1], 0)
    slots = torch.from_numpy(np.where(valid, slots, first))
    pad_bias = torch.from_numpy(np.where(valid, np.float32(0), np.float32("-inf"))[:, None, None, :])
    empty_rows = torch.from_numpy(lens_col[:, 0] == 0) if 0 in lens else None
    return DecodeGather(slots.view(-1), pad_bias, empty_rows, tokens)


def _paged_decode_batched(q, k_cache, v_cache, gather: DecodeGather, scale) -> torch.Tensor:
    batch, n_q_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]

    def rows(cache: torch.Tensor) -> torch.Tensor:  # -> [B, Hkv, tokens, D], a view of one gather
        picked = cache.view(-1, n_kv_heads, head_dim).index_select(0, gather.slots)
        return picked.view(batch, gather.tokens, n_kv_heads, head_dim).transpose(1, 2)

    k, v = rows(k_cache), rows(v_cache)
    if k.dtype != torch.float32:
        k, v = k.float(), v.float()
    # Each kv head's group of query heads is a length-`group` query sequence (no K/V repeat).
    queries = q.float().view(batch, n_kv_heads, n_q_heads // n_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(queries, k, v, attn_mask=gather.pad_bias, scale=scale)
    if gather.empty_rows is not None:  # all -inf scores
        out.masked_fill_(gather.empty_rows[:, None, None, None], 0.0)
    return out.reshape(q.shape).to(q.dtype)


def _paged_decode_torch(q, k_cache, v_cache, block_tables, context_lens, scale, gather) -> torch.Tensor:
    if gather is None:
        gather = decode_gather(block_tables, context_lens, k_cache)
    if gather is not None:
        return _paged_decode_batched(q, k_cache, v_cache, gather, scale)
    return _paged_decode_loop(q, k_cache, v_cache, block_tables, context_lens.tolist(), scale)


def _paged_decode_loop(q, k_cache, v_cache, block_tables, lens: list[int], scale) -> torch.Tensor:
    batch, n_q_heads, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    # The query-head group of each kv head is a length-`group` query sequence: no K/V repeat.
    shape = (batch, n_kv_heads, n_q_heads // n_kv_heads, head_dim)
    queries = (q.float() * scale).view(shape).unbind(0)
    out = torch.zeros(shape, dtype=torch.float32, device=q.device)  # L = 0 rows stay zero
    upcast = k_cache.dtype != torch.float32
    # One sequence at a time, gathering only its own blocks: a padded batched gather copies
    # every row up to the longest context, and a sequence's K/V (<= a few hundred KiB) stays in
    # cache between its gather and its two matmuls.
    rows = zip(lens, block_tables.unbind(0), queries, out.unbind(0), strict=True)
    for length, table, query, row_out in rows:
        if length == 0:
            continue
        blocks = table[: -(-length // block_size)]
        k = k_cache.index_select(0, blocks).view(-1, n_kv_heads, head_dim)[:length]  # [L, Hkv, D]
        v = v_cache.index_select(0, blocks).view(-1, n_kv_heads, head_dim)[:length]
        if upcast:
            k, v = k.float(), v.float()
        scores = torch.matmul(query, k.permute(1, 2, 0))  # [Hkv, group, L]
        torch.matmul(scores.softmax(dim=-1), v.transpose(0, 1), out=row_out)
    return out.view(q.shape).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    gather: DecodeGather | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache; returns [B, Hq, D] in q.dtype.

    q: [B, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hkv, D]; block_tables: int32
    [B, max_blocks] (entries past a sequence's last block are ignored); context_lens: int32 [B].
    scale defaults to 1/sqrt(D). `gather`: `decode_gather(block_tables, context_lens, k_cache)`,
    built once for the layers of a step (built here when None and the batched form applies).
    """
    _check(q, k_cache, v_cache, block_tables, context_lens)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if use_triton(q, k_cache, v_cache, block_tables, context_lens):
        return _paged_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return _paged_decode_torch(q, k_cache, v_cache, block_tables, context_lens, scale, gather)
