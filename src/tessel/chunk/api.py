"""The chunk planner's Python API: `chunk_prompts(...)`, what `tessel chunk` runs.

    from tessel.chunk.api import chunk_prompts
    outcome = chunk_prompts([32768], plan="plan.json")
    outcome.plan.chunks, outcome.plan.ttft_s, outcome.to_json()

The pipeline comes from a plan file, or from a model and a cluster split evenly over its first
`stages` devices. Problem size is bounded (`tessel.chunk.planner.MAX_GRID_STEPS`) before any table
is built.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tessel.catalog.models import ModelSpec, load_model
from tessel.chunk.baselines import baseline_plans
from tessel.chunk.bounds import lower_bound_s
from tessel.chunk.from_plan import PlanPipeline, even_split_pipeline, load_plan_pipeline
from tessel.chunk.planner import ChunkPlan, ChunkProblem, check_problem_size, plan_chunks
from tessel.cost.layer import profile_shape
from tessel.cost.profile import Profile
from tessel.cost.profile_check import checked_profiles
from tessel.errors import TesselError
from tessel.plan.files.cluster import Cluster, load_cluster


@dataclass(frozen=True, slots=True)
class ChunkOutcome:
    priced: PlanPipeline  # the stages and their latency model
    problem: ChunkProblem
    plan: ChunkPlan
    baselines: dict[str, ChunkPlan]
    lower_bound_s: float  # no chunking on the grid beats this TTFT
    planner_s: float  # wall time of the CPP planner itself

    def to_json(self) -> dict:
        problem, plan = self.problem, self.plan
        return {
            "seq_lens": list(problem.seq_lens),
            "grid_tokens": problem.grid_tokens,
            "max_chunk_tokens": problem.max_chunk_tokens,
            "stages": [
                {
                    "device": s.device,
                    "gpu_type": s.gpu_type,
                    "unit_start": s.unit_start,
                    "unit_end": s.unit_end,
                }
                for s in self.priced.stages
            ],
            "labels": self.priced.labels,
            "chunks": list(plan.chunks),
            "ttft_s": plan.ttft_s,
            "request_ttft_s": list(plan.schedule.request_ttft_s),
            "bubble_fraction": plan.bubble_fraction,
            "method": plan.method,
            "optimal": plan.optimal,
            "lower_bound_s": self.lower_bound_s,
            "planner_s": self.planner_s,
            "baselines": {
                name: {
                    "chunks": list(base.chunks),
                    "ttft_s": base.ttft_s,
                    "bubble_fraction": base.bubble_fraction,
                }
                for name, base in self.baselines.items()
            },
        }


def chunk_prompts(
    seq_lens: Sequence[int],
    *,
    plan: str | Path | None = None,
    model: str | Path | ModelSpec | None = None,
    cluster: str | Path | Cluster = "mixed-a100-v100-t4",
    stages: int | None = None,
    dtype: str = "fp16",
    grid_tokens: int = 64,
    max_chunk_tokens: int | None = None,
    profiles: Sequence[str | Path | Profile] = (),
    exact: bool | None = None,
    force_profile: bool = False,
) -> ChunkOutcome:
    """Plan CPP chunks for one prompt (or a batch, run one after the other) and the baselines; a
    profile of another device type, model shape or tessel is refused unless `force_profile`."""
    lengths = tuple(int(n) for n in seq_lens)
    check_problem_size(lengths, grid_tokens, max_chunk_tokens)  # before reading or pricing anything
    if plan is not None:
        priced = load_plan_pipeline(plan, profiles, force_profile)
    elif model is not None:
        spec = model if isinstance(model, ModelSpec) else load_model(model)
        cluster_spec = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
        types = {device.spec.base_name for device in cluster_spec.devices}
        loaded = checked_profiles(
            profiles, types, profile_shape(spec), force=force_profile, model_name=spec.name,
            cluster_name=cluster_spec.name,
        )  # fmt: skip
        priced = even_split_pipeline(spec, cluster_spec, stages, dtype=dtype, profiles=loaded)
    else:
        raise TesselError("give --plan PLAN.json, or --model (with --cluster) for an even layer split")
    problem = ChunkProblem(
        priced.pipeline,
        lengths,
        grid_tokens,
        max_chunk_tokens,
        tail_s=priced.tail_s,
        flops_linear_tokens=priced.flops_linear_tokens,
    )
    baselines = baseline_plans(problem)
    started = time.perf_counter()
    result = plan_chunks(problem, exact=exact, seeds=[base.chunks for base in baselines.values()])
    planner_s = time.perf_counter() - started
    return ChunkOutcome(priced, problem, result, baselines, lower_bound_s(problem), planner_s)
