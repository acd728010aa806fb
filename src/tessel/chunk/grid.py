"""The token grid chunk boundaries live on, and the chunk-time tables over it.

Boundaries of request r (length L_r) are its multiples of the grid (16/64 tokens, or the KV block
size) plus its end; a batch concatenates the requests, and a chunk never spans two requests (its
offset p counts tokens of its own request only). A chunk is a pair of boundaries (i, j), i < j.
`max_chunk_tokens` (the activation memory cap) removes pairs with more tokens.

Tables are kept in band form: row j, column k-1 holds the chunk (j-k, j), so the DP reads the
previous values F[j-1], F[j-2], ... as a reversed slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tessel.chunk.latency import PipelineLatency
from tessel.chunk.schedule import stage_prefill_times, stage_send_times
from tessel.errors import TesselError


@dataclass(frozen=True, slots=True)
class TokenGrid:
    seq_lens: tuple[int, ...]
    grid_tokens: int
    positions: np.ndarray  # [n+1] global token position of each boundary
    request_start: np.ndarray  # [n+1] global start of the request of the chunk ending at boundary j
    first: np.ndarray  # [n+1] smallest start boundary allowed for a chunk ending at j
    fixed: np.ndarray  # [n+1] bool: boundary must be a chunk boundary (request ends)

    @property
    def n(self) -> int:
        return len(self.positions) - 1

    @property
    def width(self) -> int:
        return int((np.arange(self.n + 1) - self.first)[1:].max())

    def chunks_from_bounds(self, bounds: Sequence[int]) -> tuple[int, ...]:
        pos = self.positions[np.asarray(bounds)]
        return tuple(int(c) for c in np.diff(pos))

    def bounds_from_chunks(self, chunks: Sequence[int]) -> list[int]:
        ends = np.concatenate([[0], np.cumsum(chunks)])
        index = np.searchsorted(self.positions, ends)
        if (index > self.n).any() or (self.positions[np.minimum(index, self.n)] != ends).any():
            raise ValueError("chunk boundaries are not on the grid")
        return [int(i) for i in index]

    def valid(self, i: int, j: int) -> bool:
        return 0 <= i < j <= self.n and i >= self.first[j]


def make_grid(
    seq_lens: Sequence[int], grid_tokens: int = 64, max_chunk_tokens: int | None = None
) -> TokenGrid:
    lens = tuple(int(n) for n in seq_lens)
    if not lens or min(lens) <= 0:
        raise TesselError(f"sequence lengths must be positive, got {list(lens)}")
    if grid_tokens <= 0:
        raise TesselError(f"--grid must be positive, got {grid_tokens}")
    if max_chunk_tokens is not None and max_chunk_tokens < min(grid_tokens, min(lens)):
        raise TesselError(
            f"max chunk tokens {max_chunk_tokens} is below the grid ({grid_tokens}): no chunking fits; "
            "raise --max-chunk-tokens or lower --grid"
        )
    positions, request_start, fixed = [0], [0], [True]
    start = 0
    for length in lens:
        local = list(range(grid_tokens, length, grid_tokens)) + [length]
        positions += [start + x for x in local]
        request_start += [start] * len(local)
        fixed += [False] * (len(local) - 1) + [True]
        start += length
    pos = np.asarray(positions, dtype=np.int64)
    req = np.asarray(request_start, dtype=np.int64)
    # first allowed start boundary: inside the same request ...
    first = np.searchsorted(pos, req, side="left")
    if max_chunk_tokens is not None:  # ... and at most max_chunk_tokens tokens
        first = np.maximum(first, np.searchsorted(pos, pos - max_chunk_tokens, side="left"))
    first[0] = 0
    if (first[1:] >= np.arange(1, len(pos))).any():
        raise TesselError(f"max chunk tokens {max_chunk_tokens} leaves some grid step without a chunk")
    return TokenGrid(lens, grid_tokens, pos, req, first, np.asarray(fixed))


def band_pairs(grid: TokenGrid, max_width: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat (j, k) of every valid chunk (j-k, j) (k <= max_width) and the [n+1, W] validity mask."""
    n, width = grid.n, grid.width if max_width is None else min(grid.width, max_width)
    k = np.arange(1, width + 1)
    j = np.arange(n + 1)[:, None]
    ok = (j - k[None, :] >= grid.first[:, None]) & (j >= 1)
    jj, kk = np.nonzero(ok)
    return jj, kk + 1, ok


def stage_tables(
    grid: TokenGrid, pipeline: PipelineLatency, max_width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """[S, n+1, W] chunk times t_s and [S, n+1, W] sends to the next stage (inf where invalid)."""
    jj, kk, ok = band_pairs(grid, max_width)
    ii = jj - kk
    c = grid.positions[jj] - grid.positions[ii]
    p = grid.positions[ii] - grid.request_start[jj]
    times, sends = [], []
    for s, stage in enumerate(pipeline.stages):
        table = np.full(ok.shape, np.inf)
        table[jj, kk - 1] = stage_prefill_times(stage, c, p)
        times.append(table)
        send = np.full(ok.shape, np.inf)
        send[jj, kk - 1] = stage_send_times(stage, c) if s < pipeline.n_stages - 1 else 0.0
        sends.append(send)
    return np.stack(times), np.stack(sends)


def surrogate_tables(grid: TokenGrid, pipeline: PipelineLatency) -> tuple[np.ndarray, np.ndarray, bool]:
    """M = max_s t_s and U = max_{s>0} (send_{s-1} + t_s) per chunk, and whether the stages are uniform.

    For any chunking, makespan <= sum_i M_i + (S-1) * max_i U_i, with equality when every stage has
    the same chunk times and every link the same send times (a uniform pipeline).
    """
    jj, kk, ok = band_pairs(grid)
    ii = jj - kk
    c = grid.positions[jj] - grid.positions[ii]
    p = grid.positions[ii] - grid.request_start[jj]
    n_stages = pipeline.n_stages
    prefill = _Memo(lambda stage: stage_prefill_times(stage, c, p), "prefill_signature")
    sending = _Memo(lambda stage: stage_send_times(stage, c), "send_signature")
    first_t = prefill(pipeline.stages[0])
    most, upper, uniform = first_t.copy(), None, True
    prev_send = None
    for s in range(1, n_stages):
        t = prefill(pipeline.stages[s])
        send = sending(pipeline.stages[s - 1])
        uniform = (
            uniform and np.array_equal(t, first_t) and (prev_send is None or np.array_equal(send, prev_send))
        )
        prev_send = send
        np.maximum(most, t, out=most)
        upper = t + send if upper is None else np.maximum(upper, t + send)
    if upper is None:
        upper = most
    m_table = np.full(ok.shape, np.inf)
    u_table = np.full(ok.shape, np.inf)
    m_table[jj, kk - 1] = most
    u_table[jj, kk - 1] = upper
    return m_table, u_table, uniform


class _Memo:
    """Per-stage arrays, computed once for stages that declare the same signature (the optional
    `prefill_signature()` / `send_signature()` methods: equal signatures, equal times)."""

    def __init__(self, compute, method: str) -> None:
        self.compute, self.method = compute, method
        self.seen: list[tuple[object, np.ndarray]] = []

    def __call__(self, stage) -> np.ndarray:
        signature = getattr(stage, self.method, None)
        if signature is None:
            return self.compute(stage)
        key = signature()
        for known, values in self.seen:
            if known == key:
                return values
        values = self.compute(stage)
        self.seen.append((key, values))
        return values
