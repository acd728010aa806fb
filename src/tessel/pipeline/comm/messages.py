"""What travels between pipeline stages: a micro-batch's `BatchMessage` and its wire format.

A micro-batch travels from one stage to the next of its path as three tensors: a fixed-size header
`[kind, payload bytes, rows, cols]`, the pickled `BatchMessage` (positions, attention metadata with
the block tables stage 0 decided, what to sample, the path) and the residual stream [rows, cols] in
the activation dtype (or, to a path's first stage that is not rank 0, the token ids). `pack_message`
pickles the message's tensors as numpy arrays, much cheaper than torch's own tensor pickling. Any
failure of the process group becomes `PeerLostError`.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tessel.engine.model_runner import PromptScoring
from tessel.engine.sampling_params import SamplingParams
from tessel.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk

BATCH, STOP, IDS = 1, 2, 3  # header kinds: a micro-batch's stream, the end, a micro-batch's token ids
HEADER_LEN = 4


class PeerLostError(RuntimeError):
    """A send or receive failed: another stage is gone (its own report names the cause)."""

    recovery = "rebuild"  # the process group is broken: restarting the engine loop cannot mend it


@dataclass(slots=True)
class BatchMessage:
    """What every stage after the first needs to run a micro-batch over its layers."""

    batch_id: int
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # rows whose logits are sampled (on the last stage)
    sample: list[tuple[int, SamplingParams]]  # (sequence id, its params) per sampled row
    released: list[int] = field(default_factory=list)  # finished sequence ids: drop their generators
    prompt_scorings: list[PromptScoring] = field(default_factory=list)  # prompt logprobs asked (last stage)
    # seeded requests moved in from another pipeline: sequence id -> noise draws their generator made
    resumed: dict[int, int] = field(default_factory=dict)
    # KV copies stage 0 made to or from its host pool before this batch (`Preemptor.copies`): every
    # stage repeats them on its own layers first, in a host pool of `host_kv_blocks` blocks
    kv_copies: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    host_kv_blocks: int = 0
    path: tuple[int, ...] = ()  # the ranks of the stages it runs on, in order (`tessel.pipeline.flow`)
    fresh_stats: bool = False  # stage 0 counts anew from this batch (after a warm-up): so does each stage
    # per sampled row: the tokens a guided request may take (int32 bitmask words), else None
    token_bitmasks: list[Any] = field(default_factory=list)


def message_on(message: BatchMessage, device: torch.device) -> BatchMessage:
    """The message with its tensors on `device` (host before pickling; the receiver's device after).
    The CPU attention's precomputed gather stays only on the CPU (the receiver rebuilds it there)."""
    if message.positions.device == device:
        return message
    meta = message.meta

    def on(t: torch.Tensor | None) -> torch.Tensor | None:  # to the host: waited for (it is pickled next)
        return None if t is None else t.to(device, non_blocking=device.type != "cpu")

    keep_gather = device.type == "cpu"
    groups = [
        DecodeGroup(g.start, g.end, on(g.block_tables), on(g.context_lens), g.gather if keep_gather else None)
        for g in meta.decode_groups
    ]
    prefills = [PrefillChunk(p.start, p.num_tokens, p.context_len, on(p.block_table)) for p in meta.prefills]
    moved = AttentionMetadata(on(meta.slot_mapping), meta.num_decode_tokens, groups, prefills)
    return replace(message, positions=on(message.positions), meta=moved)


def _tensor_as_array(tensor: torch.Tensor):  # noqa: ANN202
    """A host tensor pickled as its numpy array: a message's small index tensors cost far less
    this way than through torch's storage pickling (dtypes numpy lacks keep torch's way)."""
    try:
        return torch.from_numpy, (tensor.detach().numpy(),)
    except TypeError:  # bfloat16 and other dtypes numpy has no match for
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


_WIRE_TABLE = copyreg.dispatch_table.copy()
_WIRE_TABLE[torch.Tensor] = _tensor_as_array


def pack_message(message: BatchMessage) -> torch.Tensor:
    """The message as uint8 bytes to send (its tensors moved to the host first)."""
    return pack_payload(message_on(message, torch.device("cpu")))


def pack_payload(payload: Any) -> torch.Tensor:
    """Any picklable object whose tensors are on the host, as uint8 bytes (tensors as numpy arrays)."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _WIRE_TABLE
    pickler.dump(payload)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def unpack_message(payload: torch.Tensor, device: torch.device) -> BatchMessage:
    """The message `pack_message` sent, its tensors on `device`."""
    return message_on(pickle.loads(payload.numpy().tobytes()), device)


@dataclass(slots=True)
class KvLayout:
    """What every stage's KV pool and step graphs are sized by, agreed at start."""

    num_blocks: int  # the fewest blocks any stage's own KV budget holds (block tables are shared)
    block_size: int
    pack_cpu_linears: bool
    max_num_seqs: int
    max_model_len: int
