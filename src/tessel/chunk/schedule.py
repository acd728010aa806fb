"""Makespan of a chunking: chunks flow through the pipeline stages as a flow shop.

Chunk i (c_i tokens at offset p_i inside its request) runs on stage s after stage s has finished
chunk i-1 (stages keep chunk order: chunk i attends to the KV of chunks < i) and after its hidden
states have arrived from stage s-1:

    C(i, s) = max(C(i-1, s), C(i, s-1) + send_{s-1}(c_i)) + t_s(c_i, p_i),   C(0, .) = C(., -1) = 0

`send_{s-1}(c)` is the transfer of chunk i's hidden states from stage s-1 to stage s. It starts
when stage s-1 finishes chunk i, is asynchronous (stage s-1 goes on with chunk i+1 meanwhile, as
the runtime's isend does) and is a pure delay: transfers of consecutive chunks may overlap on
the link (link contention is not modelled). The first stage receives nothing; the last sends
nothing. TTFT = C(K, S) + `tail_s` (final norm + LM head of the last token, which only the
last chunk pays).

The recurrence is a longest path on the K x S grid; per stage it is a running maximum,

    C(k, s) = T_s(k) + max_{k' <= k} ( C(k', s-1) + send_{s-1}(k') - T_s(k'-1) ),

with T_s the prefix sums of stage s's chunk times, which numpy evaluates in O(K) per stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tessel.chunk.latency import PipelineLatency, StageLatency


def stage_prefill_times(
    stage: StageLatency, chunk_tokens: np.ndarray, offset_tokens: np.ndarray
) -> np.ndarray:
    """t_s(c, p) for arrays of chunks: the stage's vectorised `prefill_times_s` when it has one."""
    chunk_tokens = np.asarray(chunk_tokens, dtype=np.int64)
    offset_tokens = np.asarray(offset_tokens, dtype=np.int64)
    vectorised = getattr(stage, "prefill_times_s", None)
    if vectorised is not None:
        return np.broadcast_to(
            np.asarray(vectorised(chunk_tokens, offset_tokens), dtype=np.float64), chunk_tokens.shape
        )
    pairs = zip(chunk_tokens.ravel(), offset_tokens.ravel(), strict=True)
    flat = [stage.prefill_time_s(int(c), int(p)) for c, p in pairs]
    return np.asarray(flat, dtype=np.float64).reshape(chunk_tokens.shape)


def stage_send_times(stage: StageLatency, tokens: np.ndarray) -> np.ndarray:
    """send_s(c) for an array of chunk sizes (the stage's vectorised `send_times_s` when it has one)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    vectorised = getattr(stage, "send_times_s", None)
    if vectorised is not None:
        return np.broadcast_to(np.asarray(vectorised(tokens), dtype=np.float64), tokens.shape)
    flat = [stage.send_time_s(int(c)) for c in tokens.ravel()]
    return np.asarray(flat, dtype=np.float64).reshape(tokens.shape)


@dataclass(frozen=True, slots=True)
class Schedule:
    """One chunking run through the pipeline."""

    chunks: tuple[int, ...]  # token counts, in order
    offsets: tuple[int, ...]  # p_i: tokens of the same request before chunk i
    request_of_chunk: tuple[int, ...]
    stage_times_s: np.ndarray  # [S, K]: t_s(c_i, p_i)
    send_times_s: np.ndarray  # [S, K]: send from stage s to s+1 (row S-1 is zero)
    finish_s: np.ndarray  # [S, K]: C(i, s)
    tail_s: float

    @property
    def makespan_s(self) -> float:
        return float(self.finish_s[-1, -1])

    @property
    def ttft_s(self) -> float:
        """Time to first token of the last request: last chunk out of the last stage + tail."""
        return self.makespan_s + self.tail_s

    @property
    def request_ttft_s(self) -> tuple[float, ...]:
        """TTFT of each request (batch runs): its last chunk out of the last stage + tail."""
        last = {}
        for index, request in enumerate(self.request_of_chunk):
            last[request] = index
        return tuple(float(self.finish_s[-1, last[r]]) + self.tail_s for r in sorted(last))

    @property
    def start_s(self) -> np.ndarray:
        return self.finish_s - self.stage_times_s

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the S stages over [0, makespan]: 1 - sum busy / (S * makespan)."""
        n_stages = self.stage_times_s.shape[0]
        return float(1.0 - self.stage_times_s.sum() / (n_stages * self.makespan_s))


def flow_shop_finish(stage_times_s: np.ndarray, send_times_s: np.ndarray) -> np.ndarray:
    """C(i, s) for [..., S, K] stage times and sends (send row s: stage s -> s+1); batched over `...`."""
    times = np.asarray(stage_times_s, dtype=np.float64)
    sends = np.asarray(send_times_s, dtype=np.float64)
    finish = np.empty_like(times)
    prefix = np.cumsum(times[..., 0, :], axis=-1)
    finish[..., 0, :] = prefix
    for s in range(1, times.shape[-2]):
        prefix = np.cumsum(times[..., s, :], axis=-1)
        before = prefix - times[..., s, :]  # T_s(k-1)
        ready = finish[..., s - 1, :] + sends[..., s - 1, :] - before
        finish[..., s, :] = prefix + np.maximum.accumulate(ready, axis=-1)
    return finish


def chunk_offsets(
    chunks: Sequence[int], seq_lens: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Offsets p_i (inside each request) and request index of each chunk; chunks may not span requests."""
    chunks_arr = np.asarray(chunks, dtype=np.int64)
    if chunks_arr.ndim != 1 or chunks_arr.size == 0 or (chunks_arr <= 0).any():
        raise ValueError(f"chunks must be a non-empty list of positive token counts, got {list(chunks)}")
    ends = np.cumsum(chunks_arr)
    starts = ends - chunks_arr
    lens = [int(ends[-1])] if seq_lens is None else [int(n) for n in seq_lens]
    request_ends = np.cumsum(lens)
    if request_ends[-1] != ends[-1]:
        raise ValueError(f"chunks sum to {int(ends[-1])} tokens, the requests to {int(request_ends[-1])}")
    request = np.searchsorted(request_ends, starts, side="right")
    request_start = request_ends[request] - np.asarray(lens)[request]
    if (ends > request_ends[request]).any():
        raise ValueError("a chunk spans two requests; chunk boundaries must include every request end")
    return starts - request_start, request


def evaluate_chunks(
    pipeline: PipelineLatency,
    chunks: Sequence[int],
    seq_lens: Sequence[int] | None = None,
    tail_s: float = 0.0,
) -> Schedule:
    """Run `chunks` (token counts, in order; for a batch, request after request) through `pipeline`."""
    offsets, request = chunk_offsets(chunks, seq_lens)
    chunk_arr = np.asarray(chunks, dtype=np.int64)
    n_stages = pipeline.n_stages
    times = np.stack([stage_prefill_times(stage, chunk_arr, offsets) for stage in pipeline.stages])
    sends = np.zeros_like(times)
    for s in range(n_stages - 1):
        sends[s] = stage_send_times(pipeline.stages[s], chunk_arr)
    return Schedule(
        chunks=tuple(int(c) for c in chunk_arr),
        offsets=tuple(int(p) for p in offsets),
        request_of_chunk=tuple(int(r) for r in request),
        stage_times_s=times,
        send_times_s=sends,
        finish_s=flow_shop_finish(times, sends),
        tail_s=float(tail_s),
    )


def makespan_naive(stage_times_s: np.ndarray, send_times_s: np.ndarray) -> float:
    """The recurrence written out, loop by loop: the oracle the vectorised form is tested against."""
    n_stages, n_chunks = stage_times_s.shape
    finish = [[0.0] * (n_chunks + 1) for _ in range(n_stages + 1)]
    for i in range(1, n_chunks + 1):
        for s in range(1, n_stages + 1):
            arrival = finish[s - 1][i] + (send_times_s[s - 2, i - 1] if s > 1 else 0.0)
            finish[s][i] = max(finish[s][i - 1], arrival) + stage_times_s[s - 1, i - 1]
    return finish[n_stages][n_chunks]
