"""The simulator prices a tensor-parallel stage exactly as the planner does (`tessel.cost.tensor_parallel`):
one rank of the sharded model plus the all-reduces over the ring the plan file records."""

from __future__ import annotations

import numpy as np
import pytest

from plan.tp_cases import cluster, small_model, workload
from tessel.chunk.from_plan import plan_pipeline
from tessel.plan.api import PlanSettings, make_plan


def test_sim_stage_times_equal_the_planners_for_tp_stages() -> None:
    the_workload = workload(batch=2, micro_batches=2, prompt=256, output=64)  # one request per micro-batch
    the_cluster = cluster(("a", "A100-80G", 2, "nvlink"), ("b", "T4", 4, "pcie"), host_gib=16)
    outcome = make_plan(small_model(6), the_cluster, the_workload, PlanSettings(solver="dp", time_limit_s=5))
    plan = outcome.plan_file()
    assert any(s.tp_degree > 1 for s in plan.stages)
    priced = plan_pipeline(plan, plan.stages)
    evaluated = outcome.result.evaluation.stages
    context = round(the_workload.mean_decode_context_tokens)
    for index, (latency, se) in enumerate(zip(priced.pipeline.stages, evaluated, strict=True)):
        last = index == len(evaluated) - 1
        assert latency.decode_time_s(1, context) == pytest.approx(se.compute_decode_s, rel=1e-9)
        prefill = latency.prefill_time_s(256, 0) + (priced.tail_s if last else 0.0)
        assert prefill == pytest.approx(se.compute_prefill_s, rel=1e-9)
        twin = latency.prefill_times_s(np.array([1, 256, 4096]), np.array([0, 0, 512]))
        scalar = [latency.prefill_time_s(c, p) for c, p in ((1, 0), (256, 0), (4096, 512))]
        assert twin == pytest.approx(scalar, rel=1e-9)
