"""Point-to-point messages between pipeline stages over torch.distributed (gloo or NCCL).

A micro-batch travels from stage k to k+1 as three tensors: a fixed-size header
`[kind, payload bytes, rows, cols]`, the pickled `BatchMessage` (positions, attention metadata
with the block tables stage 0 decided, what to sample; `pack_message` pickles its tensors as numpy
arrays, much cheaper than torch's own tensor pickling) and the residual stream [rows, cols] in the
activation dtype. Header and message are host tensors over gloo; the stream crosses each link as
`tessel.pipeline.devices` chose for it: GPU to GPU over NCCL, or through a pinned host buffer over
gloo (copied off and onto a GPU with non-blocking copies). The
last stage sends the sampled tokens (and the logprobs asked for) back to stage 0, a
`tessel.engine.model_runner.SampledRows` (wire format: `tessel.pipeline.sampled`), on a process
group of their own that stage 0 receives on with a thread (`tessel.pipeline.token_receiver`). Sends are
non-blocking (`isend`); the next header is received with a pre-posted `irecv` so a stage's receive
overlaps its compute. Any failure of the process
group becomes `PeerLostError`. As messages move, the stage's `Progress` is updated for its
heartbeat (`tessel.pipeline.heartbeat`): when a stage starts and ends computing a micro-batch, and since
when stage 0 waits for tokens.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from tessel.engine.model_runner import PromptScoring, SampledRows
from tessel.engine.sampling_params import SamplingParams
from tessel.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from tessel.pipeline.devices import HOST, NCCL
from tessel.pipeline.heartbeat import Progress
from tessel.pipeline.sampled import HEAD_LEN, from_wire, to_wire
from tessel.pipeline.token_receiver import TokenReceiver

BATCH, STOP = 1, 2
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
    path: tuple[int, ...] = ()  # a flow plan's: the ranks of the placements it runs on, in order
    fresh_stats: bool = False  # stage 0 counts anew from this batch (after a warm-up): so does each stage


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
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _WIRE_TABLE
    pickler.dump(message_on(message, torch.device("cpu")))
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


def agree_kv_layout(capacity_blocks: int, stage0: KvLayout | None) -> KvLayout:
    """A collective at start: every stage offers the blocks its own budget holds (its layers, its
    device); all get the minimum, and stage 0's (`stage0`) block size, packing and limits."""
    try:
        blocks = torch.tensor([capacity_blocks], dtype=torch.int64)
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN)
        fields = (
            [0, 0, 0, 0]
            if stage0 is None
            else [stage0.block_size, int(stage0.pack_cpu_linears), stage0.max_num_seqs, stage0.max_model_len]
        )
        shared = torch.tensor(fields, dtype=torch.int64)
        dist.broadcast(shared, src=0)
    except RuntimeError as error:
        raise PeerLostError(f"stage {dist.get_rank()}: the start-up handshake failed: {error}") from error
    block_size, pack, max_num_seqs, max_model_len = shared.tolist()
    return KvLayout(int(blocks.item()), block_size, bool(pack), max_num_seqs, max_model_len)


class StageComm:
    """One stage's links: receive from the previous stage, send to the next, tokens to stage 0."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        dtype: torch.dtype,
        transports: list[str] | None = None,
        token_group=None,  # noqa: ANN001
    ) -> None:
        """`transports`: per link k -> k + 1, NCCL or host (default: host for every link);
        `token_group`: stage 0 and the last stage's own group, for the tokens coming back (stage 0
        receives them on a thread, `tessel.pipeline.token_receiver`); None for a subclass that
        moves tokens its own way (`tessel.pipeline.flow_routing.FlowComm`)."""
        self.rank, self.world_size = rank, world_size
        self.token_group = token_group
        last = world_size - 1
        self.receiver = TokenReceiver(last, token_group) if token_group is not None and rank == 0 else None
        self.device, self.dtype = torch.device(device), dtype
        links = transports or [HOST] * (world_size - 1)
        self.send_nccl = rank < world_size - 1 and links[rank] == NCCL
        self.recv_nccl = rank > 0 and links[rank - 1] == NCCL
        self._sends: deque[tuple[dist.Work, tuple[torch.Tensor, ...]]] = deque()
        self._next_header: tuple[dist.Work, torch.Tensor] | None = None
        self.progress = Progress()

    def _handed_on(self, batch_id: int) -> None:
        self.progress.active_since, self.progress.last_s = None, time.time()
        self.progress.last_batch = max(self.progress.last_batch, batch_id)

    @property
    def prev(self) -> int:
        return self.rank - 1

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world_size

    # ---- sending -------------------------------------------------------------------------------
    def _isend(self, tensors: tuple[torch.Tensor, ...], dst: int, group=None) -> None:  # noqa: ANN001
        try:
            works = [dist.isend(t, dst, group=group) for t in tensors]
        except RuntimeError as error:
            raise PeerLostError(f"stage {self.rank}: sending to stage {dst} failed: {error}") from error
        for work in works:
            self._sends.append((work, tensors))  # the tensors live until the send completes
        self._reap()

    def _reap(self) -> None:
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()

    def send_batch(self, message: BatchMessage, hidden: torch.Tensor) -> None:
        payload = pack_message(message)
        rows, cols = hidden.shape
        header = torch.tensor([BATCH, payload.numel(), rows, cols], dtype=torch.int64)
        self._isend((header, payload, self._outgoing(hidden.to(self.dtype))), self.next)
        if self.rank == 0:
            self.progress.last_s = time.time()
        else:
            self._handed_on(message.batch_id)

    def _outgoing(self, stream: torch.Tensor) -> torch.Tensor:
        """The stream as this stage's link sends it: on the GPU for NCCL, else in a pinned host
        buffer (the copy waited for before gloo reads it)."""
        stream = stream.contiguous()
        if self.send_nccl or not stream.is_cuda:
            return stream
        staged = torch.empty(stream.shape, dtype=stream.dtype, pin_memory=True)
        staged.copy_(stream, non_blocking=True)
        torch.cuda.current_stream(stream.device).synchronize()
        return staged

    def send_stop(self) -> None:
        if self.rank < self.world_size - 1:
            self._isend((torch.tensor([STOP, 0, 0, 0], dtype=torch.int64),), self.next)

    def send_tokens(self, batch_id: int, sampled: SampledRows) -> None:
        self._isend(tuple(to_wire(sampled, batch_id)), 0, self.token_group)
        self._handed_on(batch_id)

    def flush(self) -> None:
        """Wait until every send has been received."""
        try:
            while self._sends:
                self._sends.popleft()[0].wait()
        except RuntimeError as error:
            raise PeerLostError(f"stage {self.rank}: a send did not complete: {error}") from error

    # ---- receiving -----------------------------------------------------------------------------
    def _post_header(self) -> None:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self._next_header = (dist.irecv(header, self.prev), header)

    def recv_batch(self) -> tuple[BatchMessage, torch.Tensor] | None:
        """The next micro-batch from the previous stage; None when stage 0 says stop."""
        try:
            if self._next_header is None:
                self._post_header()
            work, header = self._next_header
            work.wait()
            kind, size, rows, cols = (int(v) for v in header.tolist())
            if kind == STOP:
                self._next_header = None
                self.progress.last_s = time.time()
                return None
            payload = torch.empty(size, dtype=torch.uint8)
            dist.recv(payload, self.prev)
            hidden = self._incoming(rows, cols)
            self._post_header()  # the next header arrives while this batch computes
        except RuntimeError as error:
            raise PeerLostError(
                f"stage {self.rank}: receiving from stage {self.prev} failed: {error}"
            ) from error
        self.progress.active_since = self.progress.last_s = time.time()
        return unpack_message(payload, self.device), hidden

    def _incoming(self, rows: int, cols: int) -> torch.Tensor:
        """Receive the stream [rows, cols] as the link sends it, onto this stage's device."""
        if self.recv_nccl or self.device.type == "cpu":
            hidden = torch.empty(rows, cols, dtype=self.dtype, device=self.device)
            dist.recv(hidden, self.prev)
            return hidden
        staged = torch.empty(rows, cols, dtype=self.dtype, pin_memory=True)
        dist.recv(staged, self.prev)
        return staged.to(self.device, non_blocking=True)

    def expect_tokens(self, count: int) -> None:
        """Stage 0, after sending a micro-batch: it samples `count` rows (the receiver thread
        takes its tokens as they come)."""
        if self.receiver is not None:
            self.receiver.expect(count)

    def tokens_ready(self) -> bool:
        """Stage 0: whether the oldest owed micro-batch's tokens are here."""
        return self.receiver is not None and self.receiver.ready()

    def recv_tokens(self, batch_id: int, count: int) -> SampledRows:
        """Stage 0: the `count` tokens (and logprobs) the last stage sampled for micro-batch `batch_id`."""
        self.progress.owed_batch, self.progress.owed_since = batch_id, time.time()
        try:
            values, payload = self.receiver.take()
        except RuntimeError as error:
            raise PeerLostError(
                f"stage 0: receiving tokens from stage {self.world_size - 1} failed: {error}"
            ) from error
        self.progress.owed_since = None
        self._handed_on(batch_id)
        if values[0] != batch_id:
            raise PeerLostError(f"stage 0: expected the tokens of micro-batch {batch_id}, got {values[0]}")
        return from_wire(values[HEAD_LEN:], payload)

    def close(self) -> None:
        """Stage 0, after its last tokens: stop the receiver thread."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
