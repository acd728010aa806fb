"""A lower bound on the TTFT of every chunking: how far from optimal a plan can be at most.

Stage s runs every chunk one after another; it cannot start the first chunk (c_1 tokens) before
that chunk has passed the stages before it, and the last chunk (c_K tokens) still has to pass the
stages after it. So for any chunking, on every stage s,

    makespan >= head_s(c_1) + sum_i t_s(c_i, p_i) + drain_s(c_K, p_K),
    head_s(c)     = sum_{q<s} (t_q(c, 0) + send_q(c)),
    drain_s(c, p) = sum_{q>s} (send_{q-1}(c) + t_q(c, p)),

and the least right-hand side over all grid chunkings is a DP over the grid (the first chunk's
cost carries the head, the last one's the drain). The bound is the largest over stages, plus the
tail. For one stage it is the optimum itself; with several it leaves out the pipeline fill inside
the bottleneck stage, so it is below the optimum by at most about one chunk's time per stage.
"""

from __future__ import annotations

import numpy as np

from tessel.chunk.grid import TokenGrid, band_pairs, make_grid
from tessel.chunk.planner import ChunkProblem
from tessel.chunk.schedule import stage_prefill_times, stage_send_times


def lower_bound_s(problem: ChunkProblem) -> float:
    """A TTFT no chunking on the problem's grid (and memory cap) can beat."""
    grid = make_grid(problem.seq_lens, problem.grid_tokens, problem.max_chunk_tokens)
    stages = problem.pipeline.stages
    n_stages, n, width = len(stages), grid.n, grid.width
    pos, req = grid.positions, grid.request_start
    # chunks (0, j): head on every stage (time through the stages before it)
    ends = np.arange(1, min(n, width) + 1)
    ends = ends[grid.first[ends] == 0]
    c_first, p_first = pos[ends], np.zeros(len(ends), dtype=np.int64)
    t_first = np.stack([stage_prefill_times(stage, c_first, p_first) for stage in stages])
    head = np.zeros((n_stages, len(ends)))
    for s in range(1, n_stages):
        head[s] = head[s - 1] + t_first[s - 1] + stage_send_times(stages[s - 1], c_first)
    # chunks (n-k, n): drain through the stages after s
    span_n = min(n - int(grid.first[n]), width)
    starts = n - np.arange(1, span_n + 1)
    c_last, p_last = pos[n] - pos[starts], pos[starts] - req[n]
    t_last = np.stack([stage_prefill_times(stage, c_last, p_last) for stage in stages])
    drain = np.zeros((n_stages, span_n))
    for s in range(n_stages - 2, -1, -1):
        drain[s] = drain[s + 1] + stage_send_times(stages[s], c_last) + t_last[s + 1]
    tables: list[tuple[object, np.ndarray]] = []
    bound = 0.0
    for s, stage in enumerate(stages):
        table = _table(grid, stage, tables)
        first = np.full(n + 1, np.inf)
        first[ends] = head[s] + t_first[s]
        best = first.copy()  # least head + work over chunkings of boundaries 0..j
        for j in range(2, n + 1):
            span = min(j - int(grid.first[j]), width, j - 1)  # chunks (j-k, j) not starting at 0
            if span > 0:
                best[j] = min(first[j], float(np.min(best[j - span : j][::-1] + table[j, :span])))
        before = best[starts].copy()
        if starts[-1] == 0:  # the whole prompt as one chunk carries the head instead
            before[-1] = head[s][ends == n][0]
        bound = max(bound, float(np.min(before + t_last[s] + drain[s])))
    return bound + problem.tail_s


def _table(grid: TokenGrid, stage, known: list[tuple[object, np.ndarray]]) -> np.ndarray:
    """[n+1, W] chunk times of one stage (shared by stages with the same `prefill_signature`)."""
    signature = stage.prefill_signature() if hasattr(stage, "prefill_signature") else None
    for key, table in known:
        if signature is not None and key == signature:
            return table
    jj, kk, ok = band_pairs(grid)
    ii = jj - kk
    table = np.full(ok.shape, np.inf)
    table[jj, kk - 1] = stage_prefill_times(
        stage, grid.positions[jj] - grid.positions[ii], grid.positions[ii] - grid.request_start[jj]
    )
    if signature is not None:
        known.append((signature, table))
    return table
