"""Chunkings the planner is compared against, each scored with the same flow-shop recurrence.

- `none`: every prompt in one piece (plain pipeline parallelism, no CPP).
- `fixed-<n>`: chunks of n tokens (the last one shorter), as vLLM / SGLang chunked prefill do.
- `fixed-best`: the best fixed size over grid multiples (a geometric set of them on long grids).
- `seq1f1b`: Seq1F1B's equal-FLOP chunks. Attention makes later tokens dearer: the FLOPs of the
  first x tokens of a request are proportional to `L*x + x^2/2` (L = matmul FLOPs per token over
  attention FLOPs per token-key pair, 2*P_matmul / (4*a*d) per layer), so boundary k of K solves
  `L*b + b^2/2 = k/K * (L*N + N^2/2)`; best K searched.
- `sglang-dynamic`: SGLang's dynamic chunking. It fits the cumulative runtime of a prefix as
  `R(x) = a*x^2 + b*x` and picks the next chunk at prefix L as the root of
  `R(L + dL) - R(L) = R(c0)` (c0 the initial chunk size), smoothed to `c0 + sigma*(dL - c0)`
  (sigma = SGLANG_DYNAMIC_CHUNKING_SMOOTH_FACTOR, default 0.75), at least c0/4, aligned down to
  max(grid, 64) tokens. R is fitted here to the slowest stage's times; best c0 searched.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tessel.chunk.planner import ChunkPlan, ChunkProblem
from tessel.chunk.schedule import evaluate_chunks, stage_prefill_times

FIXED_SIZES = (512, 2048)
SGLANG_SMOOTH_FACTOR = 0.75  # SGLang's default SGLANG_DYNAMIC_CHUNKING_SMOOTH_FACTOR
SGLANG_MIN_ALIGN = 64  # SGLang aligns dynamic chunk sizes to max(page_size, 64)
MAX_SEARCH_SIZES = 96  # candidate sizes tried by the "best" searches


def _per_request(problem: ChunkProblem, split: Callable[[int], list[int]]) -> list[int]:
    chunks: list[int] = []
    for length in problem.seq_lens:
        chunks += split(length)
    return chunks


def _capped(size: int, problem: ChunkProblem) -> int:
    return size if problem.max_chunk_tokens is None else max(1, min(size, problem.max_chunk_tokens))


def fixed_chunks(length: int, size: int) -> list[int]:
    full, rest = divmod(length, size)
    return [size] * full + ([rest] if rest else [])


def _plan(problem: ChunkProblem, chunks: list[int], method: str) -> ChunkPlan:
    schedule = evaluate_chunks(problem.pipeline, chunks, problem.seq_lens, problem.tail_s)
    return ChunkPlan(schedule, method, optimal=False)


def _best(problem: ChunkProblem, options: list[list[int]], method: str) -> ChunkPlan:
    plans = [_plan(problem, chunks, method) for chunks in options]
    return min(plans, key=lambda plan: plan.ttft_s)


def _grid_sizes(problem: ChunkProblem) -> list[int]:
    longest = max(problem.seq_lens)
    if problem.max_chunk_tokens is not None:
        longest = min(longest, problem.max_chunk_tokens)
    steps = max(1, longest // problem.grid_tokens)
    multiples = np.unique(np.geomspace(1, steps, min(steps, MAX_SEARCH_SIZES)).round().astype(int))
    return [int(m) * problem.grid_tokens for m in multiples] + (
        [longest] if longest % problem.grid_tokens else []
    )


def equal_flop_chunks(length: int, n_chunks: int, linear_tokens: float, align: int) -> list[int]:
    k = np.arange(1, n_chunks)
    if not np.isfinite(linear_tokens) or linear_tokens > 1e6 * length:  # no attention term: equal tokens
        bounds = k / n_chunks * length
    else:
        total = linear_tokens * length + length**2 / 2
        bounds = -linear_tokens + np.sqrt(linear_tokens**2 + 2 * k / n_chunks * total)
    bounds = np.round(bounds / align).astype(int) * align
    cuts = sorted({int(b) for b in bounds if 0 < b < length})
    return list(np.diff([0, *cuts, length]).astype(int))


def sglang_chunks(length: int, base: int, quad: float, lin: float, align: int, cap: int | None) -> list[int]:
    target = quad * base**2 + lin * base
    chunks, done = [], 0
    while done < length:
        b = 2 * quad * done + lin
        if quad > 0:
            ideal = (-b + np.sqrt(b * b + 4 * quad * target)) / (2 * quad)
        else:
            ideal = target / b if b > 0 else base
        size = max(int(base + SGLANG_SMOOTH_FACTOR * (ideal - base)), base // 4)
        size = max((size // align) * align, align)
        if cap is not None:
            size = min(size, cap)
        size = min(size, length - done)
        chunks.append(size)
        done += size
    return chunks


def linear_tokens_estimate(problem: ChunkProblem) -> float:
    """L for Seq1F1B from the problem, or fitted to stage 0 as t(c, 0) ~ x*c + y*c^2/2 -> L = x/y."""
    if problem.flops_linear_tokens is not None:
        return problem.flops_linear_tokens
    quad, lin = _quadratic_fit(problem, 0)
    return lin / (2 * quad) if quad > 0 else float("inf")


def _quadratic_fit(problem: ChunkProblem, stage_index: int | None) -> tuple[float, float]:
    """(a, b) of R(x) = a*x^2 + b*x fitted to prefix runtimes t(x, 0) (slowest stage when None)."""
    longest = max(problem.seq_lens)
    xs = np.unique(np.linspace(min(problem.grid_tokens, longest), longest, 16).round().astype(np.int64))
    stages = problem.pipeline.stages if stage_index is None else [problem.pipeline.stages[stage_index]]
    runtimes = np.max([stage_prefill_times(s, xs, np.zeros_like(xs)) for s in stages], axis=0)
    design = np.stack([xs.astype(float) ** 2, xs.astype(float)], axis=1)
    (a, b), *_ = np.linalg.lstsq(design / runtimes[:, None], np.ones_like(runtimes), rcond=None)
    return max(float(a), 0.0), max(float(b), 0.0)


def baseline_plans(problem: ChunkProblem, fixed_sizes: tuple[int, ...] = FIXED_SIZES) -> dict[str, ChunkPlan]:
    plans = {"none": _plan(problem, list(problem.seq_lens), "none")}
    if problem.max_chunk_tokens is not None and max(problem.seq_lens) > problem.max_chunk_tokens:
        del plans["none"]  # does not fit the memory cap
    for size in fixed_sizes:
        size = _capped(size, problem)
        plans[f"fixed-{size}"] = _plan(
            problem, _per_request(problem, lambda n, s=size: fixed_chunks(n, s)), "fixed"
        )
    sizes = _grid_sizes(problem)
    plans["fixed-best"] = _best(
        problem, [_per_request(problem, lambda n, s=s: fixed_chunks(n, s)) for s in sizes], "fixed-best"
    )
    linear = linear_tokens_estimate(problem)
    align = problem.grid_tokens
    longest = max(problem.seq_lens)
    most_chunks = max(1, longest // align)
    counts = np.unique(np.geomspace(1, most_chunks, min(most_chunks, MAX_SEARCH_SIZES)).round().astype(int))
    options = []
    for count in counts:
        chunks = _per_request(problem, lambda n, k=int(count): equal_flop_chunks(n, k, linear, align))
        if problem.max_chunk_tokens is None or max(chunks) <= problem.max_chunk_tokens:
            options.append(chunks)
    if options:
        plans["seq1f1b"] = _best(problem, options, "seq1f1b")
    quad, lin = _quadratic_fit(problem, None)
    sg_align = max(align, SGLANG_MIN_ALIGN)
    plans["sglang-dynamic"] = _best(
        problem,
        [
            _per_request(
                problem, lambda n, c=c: sglang_chunks(n, c, quad, lin, sg_align, problem.max_chunk_tokens)
            )
            for c in sizes
            if c >= sg_align
        ]
        or [_per_request(problem, lambda n: fixed_chunks(n, sg_align))],
        "sglang-dynamic",
    )
    return plans
