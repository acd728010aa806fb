"""One stage's links: micro-batches along their paths over torch.distributed, tokens back to stage 0.

A stage sends each micro-batch to the next stage of the micro-batch's path (`BatchMessage.path`,
`tessel.pipeline.flow`); rank 0 hands a path that does not start on it the token ids instead of a
stream. The stream crosses each link as `tessel.pipeline.devices` chose for it: GPU to GPU over NCCL,
or through a pinned host buffer over gloo (copied off and onto a GPU with non-blocking copies);
headers, messages and tokens are host tensors over gloo. Sends are non-blocking (`isend`). A stage
with one predecessor pre-posts the receive of the next header (`irecv`), so its receive overlaps its
compute; one with several (a placement several paths go through) receives from any of them. The
stages that sample send the tokens back to stage 0 on a process group of their own, which stage 0
receives on with a thread each (`tessel.pipeline.comm.tokens`). Any failure of the process group
becomes `PeerLostError`. As messages move, the stage's `StageProgress` is updated for its heartbeat
(`tessel.pipeline.supervision.heartbeat`): when a stage starts and ends computing a micro-batch,
and since when stage 0 waits for tokens.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from tessel.engine.model_runner import SampledRows
from tessel.pipeline.comm.messages import (
    BATCH,
    HEADER_LEN,
    IDS,
    STOP,
    BatchMessage,
    PeerLostError,
    pack_message,
    unpack_message,
)
from tessel.pipeline.comm.tokens import TokenReceiver, to_wire
from tessel.pipeline.devices import NCCL
from tessel.pipeline.flow import FlowPath, last_ranks, neighbours
from tessel.pipeline.supervision.heartbeat import StageProgress

Received = tuple[BatchMessage, torch.Tensor | None, torch.Tensor | None]  # message, stream, token ids


class StageComm:
    """Stage `rank`'s links over `paths`: `transports` maps a link (sender, receiver) to NCCL (host
    otherwise); `token_groups` maps each stage that samples to its group with stage 0."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        dtype: torch.dtype,
        paths: tuple[FlowPath, ...],
        transports: dict[tuple[int, int], str] | None = None,
        token_groups: dict | None = None,
    ) -> None:
        self.rank, self.device, self.dtype = rank, torch.device(device), dtype
        successors, predecessors = neighbours(paths)
        self.successors = sorted(successors.get(rank, ()))
        self.predecessors = sorted(predecessors.get(rank, ()))
        self.transports = transports or {}
        token_groups = token_groups or {}
        self.token_group = token_groups.get(rank)
        self.receivers: dict[int, TokenReceiver] = {}
        if rank == 0:
            self.receivers = {r: TokenReceiver(r, token_groups[r]) for r in last_ranks(paths) if r != 0}
        self._source: dict[int, int] = {}  # rank 0: micro-batch -> the stage that samples it
        self._sends: deque[tuple[dist.Work, tuple[torch.Tensor, ...]]] = deque()
        self._next_header: tuple[dist.Work, torch.Tensor] | None = None
        self._stops = 0
        self.progress = StageProgress()

    def _handed_on(self, batch_id: int) -> None:
        self.progress.active_since, self.progress.last_s = None, time.time()
        self.progress.last_batch = max(self.progress.last_batch, batch_id)

    def _link(self, a: int, b: int) -> str | None:
        return self.transports.get((a, b))

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

    def next_of(self, path: tuple[int, ...]) -> int:
        """The stage this one sends a micro-batch of `path` to."""
        if self.rank == 0 and path[0] != 0:
            return path[0]
        return path[path.index(self.rank) + 1]

    def send_batch(
        self, message: BatchMessage, hidden: torch.Tensor | None, input_ids: torch.Tensor | None = None
    ) -> None:
        """`hidden` to the next stage of the message's path; rank 0 with `hidden` None sends the token
        ids instead (to a path's first stage)."""
        dst = self.next_of(message.path)
        payload = pack_message(message)
        if hidden is None:
            ids = input_ids.to("cpu", torch.int64).contiguous()
            header = torch.tensor([IDS, payload.numel(), ids.numel(), 0], dtype=torch.int64)
            self._isend((header, payload, ids), dst)
        else:
            rows, cols = hidden.shape
            header = torch.tensor([BATCH, payload.numel(), rows, cols], dtype=torch.int64)
            stream = self._outgoing(hidden.to(self.dtype), self._link(self.rank, dst) == NCCL)
            self._isend((header, payload, stream), dst)
        if self.rank == 0:
            self.progress.last_s = time.time()
        else:
            self._handed_on(message.batch_id)

    def _outgoing(self, stream: torch.Tensor, nccl: bool) -> torch.Tensor:
        """The stream as this link sends it: on the GPU for NCCL, else in a pinned host buffer (the
        copy waited for before gloo reads it)."""
        stream = stream.contiguous()
        if nccl or not stream.is_cuda:
            return stream
        staged = torch.empty(stream.shape, dtype=stream.dtype, pin_memory=True)
        staged.copy_(stream, non_blocking=True)
        torch.cuda.current_stream(stream.device).synchronize()
        return staged

    def send_stop(self) -> None:
        for dst in self.successors:
            self._isend((torch.tensor([STOP, 0, 0, 0], dtype=torch.int64),), dst)

    def send_tokens(self, batch_id: int, sampled: SampledRows) -> None:
        self._isend(to_wire(sampled, batch_id), 0, self.token_group)
        self._handed_on(batch_id)

    def flush(self) -> None:
        """Wait until every send has been received."""
        try:
            while self._sends:
                self._sends.popleft()[0].wait()
        except RuntimeError as error:
            raise PeerLostError(f"stage {self.rank}: a send did not complete: {error}") from error

    # ---- receiving -----------------------------------------------------------------------------
    def recv_batch(self) -> Received | None:
        """The next micro-batch from a predecessor: (message, stream or None, token ids or None);
        None once every predecessor said stop."""
        try:
            while True:
                src, header = self._header()
                kind, size, rows, cols = (int(v) for v in header.tolist())
                if kind != STOP:
                    break
                self._stops += 1
                if self._stops >= len(self.predecessors):
                    self.progress.last_s = time.time()
                    return None
            payload = torch.empty(size, dtype=torch.uint8)
            dist.recv(payload, src)
            stream = ids = None
            if kind == IDS:
                ids = torch.empty(rows, dtype=torch.int64)
                dist.recv(ids, src)
                ids = ids.to(self.device)
            else:
                stream = self._incoming(src, rows, cols)
            if len(self.predecessors) == 1:
                self._post_header()  # the next header arrives while this batch computes
        except RuntimeError as error:
            raise PeerLostError(f"stage {self.rank}: receiving a micro-batch failed: {error}") from error
        self.progress.active_since = self.progress.last_s = time.time()
        return unpack_message(payload, self.device), stream, ids

    def _post_header(self) -> None:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self._next_header = (dist.irecv(header, self.predecessors[0]), header)

    def _header(self) -> tuple[int, torch.Tensor]:
        """(sender, header) of the next message: the pre-posted receive from the one predecessor, or
        a receive from any of several."""
        if len(self.predecessors) != 1:
            header = torch.empty(HEADER_LEN, dtype=torch.int64)
            return dist.recv(header), header
        if self._next_header is None:
            self._post_header()
        work, header = self._next_header
        self._next_header = None
        work.wait()
        return self.predecessors[0], header

    def _incoming(self, src: int, rows: int, cols: int) -> torch.Tensor:
        """Receive the stream [rows, cols] as the link sends it, onto this stage's device."""
        if self._link(src, self.rank) == NCCL or self.device.type == "cpu":
            hidden = torch.empty(rows, cols, dtype=self.dtype, device=self.device)
            dist.recv(hidden, src)
            return hidden
        staged = torch.empty(rows, cols, dtype=self.dtype, pin_memory=True)
        dist.recv(staged, src)
        return staged.to(self.device, non_blocking=True)

    # ---- stage 0: the tokens coming back ---------------------------------------------------------
    def expect_tokens(self, batch_id: int, source: int) -> None:
        """Rank 0, after sending micro-batch `batch_id`: stage `source` samples it."""
        self._source[batch_id] = source
        self.receivers[source].expect()

    def tokens_ready(self, batch_id: int) -> bool:
        """Rank 0: whether micro-batch `batch_id`'s tokens are here."""
        return self.receivers[self._source[batch_id]].ready(batch_id)

    def recv_tokens(self, batch_id: int, count: int) -> SampledRows:
        """Rank 0: the `count` tokens (and logprobs) sampled for micro-batch `batch_id`."""
        source = self._source.pop(batch_id)
        self.progress.owed_batch, self.progress.owed_since = batch_id, time.time()
        try:
            rows = self.receivers[source].take(batch_id)
        except (RuntimeError, ValueError) as error:
            raise PeerLostError(f"stage 0: receiving tokens from stage {source} failed: {error}") from error
        self.progress.owed_since = None
        self._handed_on(batch_id)
        if len(rows.tokens) != count:
            raise PeerLostError(
                f"stage 0: micro-batch {batch_id} came back with {len(rows.tokens)} tokens, not {count}"
            )
        return rows

    def abort(self, error: BaseException) -> None:
        """Rank 0: every wait for tokens raises `error` from now on (a stage is known lost)."""
        for receiver in self.receivers.values():
            receiver.abort(error)

    def close(self) -> None:
        """Rank 0, after its last tokens: stop the receiver threads."""
        for receiver in self.receivers.values():
            receiver.close()
        self.receivers = {}
