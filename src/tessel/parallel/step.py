"""What the leader broadcasts to its followers: each a pickled object over the group's gloo.

    RankSetup    once, after loading: the KV pool the followers allocate (the leader's size)
    TPStep       each forward: token ids or the received residual stream, positions, attention
                 metadata (slot mapping, decode block tables and context lengths, prefill chunks;
                 the CPU's batched decode gather is rebuilt by each follower on its own cache)
    LogitsCall   each LM head projection: the hidden rows the leader projects (prompt scoring,
                 sampled rows, in the leader's order); every rank projects its vocabulary columns
    None         stop

`ModelRunner.prepare` runs on the leader only (it reads the sequences); the followers only ever see
its tensors, so the forward on every rank is the one `ModelRunner._forward` runs.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch

from tessel.kernels.paged_decode import decode_gather
from tessel.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from tessel.parallel.group import TPGroup
from tessel.pipeline.comm.messages import pack_payload


@dataclass(frozen=True, slots=True)
class RankSetup:
    num_blocks: int
    block_size: int
    pack_cpu_linears: bool


@dataclass(slots=True)
class TPStep:
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    input_ids: torch.Tensor | None = None  # int64 [T] (the first stage)
    stream: torch.Tensor | None = None  # [T, H] the residual stream a later pipeline stage received


@dataclass(slots=True)
class LogitsCall:
    hidden: torch.Tensor  # [N, H] the rows the leader projects


def with_gather(meta: AttentionMetadata, kv_cache: torch.Tensor) -> AttentionMetadata:
    """Give `meta`'s decode groups the CPU batched gather over this rank's cache, as `prepare` does."""
    if kv_cache.is_cuda or not kv_cache.shape[1]:
        return meta
    for group in meta.decode_groups:
        if group.end - group.start > 1:
            group.gather = decode_gather(group.block_tables, group.context_lens, kv_cache[0, 0])
    return meta


def broadcast(group: TPGroup, message: RankSetup | TPStep | LogitsCall | None) -> None:
    """The leader sends `message` to its followers (None: stop)."""
    if isinstance(message, TPStep):
        message = moved(message, torch.device("cpu"))
    elif isinstance(message, LogitsCall):
        message = LogitsCall(message.hidden.cpu())
    group.broadcast_bytes(None if message is None else pack_payload(message))


def receive(group: TPGroup) -> RankSetup | TPStep | LogitsCall | None:
    """A follower's next message from the leader (None: stop), its tensors on the rank's device."""
    payload = group.broadcast_bytes(None)
    if payload is None:
        return None
    message = pickle.loads(payload.numpy().tobytes())
    if group.device.type == "cpu":
        return message
    if isinstance(message, TPStep):
        return moved(message, group.device)
    if isinstance(message, LogitsCall):
        return LogitsCall(message.hidden.to(group.device))
    return message


def moved(step: TPStep, device: torch.device) -> TPStep:
    """A copy of `step` (gathers dropped) with its tensors on `device`; the original is untouched."""

    def on(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=device.type != "cpu")

    meta = step.meta
    groups = [DecodeGroup(g.start, g.end, on(g.block_tables), on(g.context_lens)) for g in meta.decode_groups]
    prefills = [PrefillChunk(p.start, p.num_tokens, p.context_len, on(p.block_table)) for p in meta.prefills]
    moved_meta = AttentionMetadata(on(meta.slot_mapping), meta.num_decode_tokens, groups, prefills)
    return TPStep(on(step.positions), moved_meta, on(step.input_ids), on(step.stream))
