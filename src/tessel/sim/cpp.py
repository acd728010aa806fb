"""Chunked pipeline parallelism in the simulator: cut each prompt as `tessel.chunk` plans it.

The cut of a prompt of n tokens is the TeraPipe DP of `tessel.chunk.planner` on the plan's
pipeline (no local search, no exact search: one DP pass per distinct prompt length, cached), so
simulating thousands of requests stays fast. Use it with `SimSchedulerConfig(pipelined_prefill=True)`
so that the chunks of one prompt follow each other through the stages.
"""

from __future__ import annotations

from tessel.chunk.latency import PipelineLatency
from tessel.chunk.planner import ChunkProblem, plan_chunks
from tessel.sim.requests import Request
from tessel.sim.scheduler import ChunkSizer

DEFAULT_GRID_TOKENS = 64  # chunk boundaries on multiples of 64 tokens (SPEC section 3)


def cpp_chunk_sizer(
    pipeline: PipelineLatency, grid_tokens: int = DEFAULT_GRID_TOKENS, max_chunk_tokens: int | None = None
) -> ChunkSizer:
    """A `ChunkSizer` for `SimSchedulerConfig.chunk_sizes`: request -> its prompt's chunk sizes."""
    cache: dict[int, list[int]] = {}

    def sizes(request: Request) -> list[int]:
        n = request.prompt_tokens
        if n not in cache:
            problem = ChunkProblem(pipeline, (n,), grid_tokens, max_chunk_tokens)
            cache[n] = list(plan_chunks(problem, exact=False, local_search=False).chunks)
        return cache[n]

    return sizes
