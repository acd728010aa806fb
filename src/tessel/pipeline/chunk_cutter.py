"""CPP prefill in the runtime: cut a long prompt as the chunk planner does for this pipeline.

The cut is the one the simulator's `--cpp` uses (`tessel.sim.cpp.cpp_chunk_sizer`: the TeraPipe DP
of `tessel.chunk` on the plan's priced pipeline, a 64-token grid, cached per length), so a
measured CPP run and its prediction cut prompts the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessel.chunk.latency import PipelineLatency
from tessel.sim.cpp import DEFAULT_GRID_TOKENS, cpp_chunk_sizer
from tessel.sim.requests import Request

DEFAULT_CPP_MIN_TOKENS = 512  # shorter prompts gain little from chunking on a few stages


@dataclass(slots=True)
class ChunkCutter:
    pipeline: PipelineLatency
    min_tokens: int = DEFAULT_CPP_MIN_TOKENS
    grid_tokens: int = DEFAULT_GRID_TOKENS
    max_chunk_tokens: int | None = None
    _sizer: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._sizer = cpp_chunk_sizer(self.pipeline, self.grid_tokens, self.max_chunk_tokens)

    def wants(self, num_tokens: int) -> bool:
        """Whether a prefill of `num_tokens` tokens is cut (longer than `min_tokens`)."""
        return num_tokens > self.min_tokens

    def chunks(self, num_tokens: int) -> list[int]:
        """Chunk sizes (in order, summing to `num_tokens`) for a prefill of `num_tokens` tokens."""
        sizes = list(self._sizer(Request(0, 0.0, num_tokens, 1)))
        assert sum(sizes) == num_tokens, (sizes, num_tokens)
        return sizes
