"""What the leader broadcasts each step so that every follower runs the same forward.

`ModelRunner.prepare` runs on the leader only (it reads the sequences); the followers get its
result: token ids, positions, the attention metadata (slot mapping, decode block tables and
context lengths, prefill chunks; the CPU's batched decode gather is rebuilt by each follower on
its own cache) and which rows the LM head projects, in the order the leader's sampling projects
them (prompt scorings first, then the sampled rows: `ModelRunner.sample_hidden`).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import torch

from tessel.kernels.paged_decode import decode_gather
from tessel.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from tessel.parallel.group import TPGroup
from tessel.pipeline.comm.messages import pack_payload


@dataclass(slots=True)
class TPStep:
    input_ids: torch.Tensor | None  # int64 [T]; None where a later pipeline stage gets the stream
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    sample_rows: list[int] = field(default_factory=list)
    scoring_rows: list[tuple[int, int]] = field(default_factory=list)  # (first row, rows) per prompt scoring


def with_gather(meta: AttentionMetadata, kv_cache: torch.Tensor) -> AttentionMetadata:
    """Give `meta`'s decode groups the CPU batched gather over this rank's cache, as `prepare` does."""
    if kv_cache.is_cuda or not kv_cache.shape[1]:
        return meta
    for group in meta.decode_groups:
        if group.end - group.start > 1:
            group.gather = decode_gather(group.block_tables, group.context_lens, kv_cache[0, 0])
    return meta


def to_host(step: TPStep) -> TPStep:
    return _moved(step, torch.device("cpu"))


def broadcast_step(group: TPGroup, step: TPStep | None) -> None:
    """The leader sends `step` to its followers (None: stop)."""
    group.broadcast_bytes(None if step is None else pack_payload(to_host(step)))


def receive_step(group: TPGroup) -> TPStep | None:
    """A follower's next step from the leader (None: stop), its tensors on the rank's device."""
    payload = group.broadcast_bytes(None)
    if payload is None:
        return None
    step: TPStep = pickle.loads(payload.numpy().tobytes())
    if group.device.type != "cpu":
        step = _moved(step, group.device)
    return step


def _moved(step: TPStep, device: torch.device) -> TPStep:
    """A copy of `step` (gathers dropped) with its tensors on `device`; the original is untouched."""

    def on(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=device.type != "cpu")

    meta = step.meta
    groups = [DecodeGroup(g.start, g.end, on(g.block_tables), on(g.context_lens)) for g in meta.decode_groups]
    prefills = [PrefillChunk(p.start, p.num_tokens, p.context_len, on(p.block_table)) for p in meta.prefills]
    moved = AttentionMetadata(on(meta.slot_mapping), meta.num_decode_tokens, groups, prefills)
    return TPStep(on(step.input_ids), on(step.positions), moved, step.sample_rows, step.scoring_rows)
