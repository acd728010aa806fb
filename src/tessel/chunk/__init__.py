"""Chunked pipeline parallelism (CPP): cut long prompts into chunks that flow through the stages.

`planner.plan_chunks` picks the chunks, `schedule.evaluate_chunks` scores any chunking with the
flow-shop recurrence, `baselines.baseline_plans` gives the chunkings it is compared against, and
`from_plan` prices a plan's stages with the cost model. No torch anywhere here.
"""

from __future__ import annotations

from tessel.chunk.latency import PipelineLatency, StageLatency
from tessel.chunk.planner import ChunkPlan, ChunkProblem, plan_chunks
from tessel.chunk.schedule import Schedule, evaluate_chunks

__all__ = [
    "ChunkPlan",
    "ChunkProblem",
    "PipelineLatency",
    "Schedule",
    "StageLatency",
    "evaluate_chunks",
    "plan_chunks",
]
