"""The plan file of an online plan (`tessel.plan.files.plan_file`, replicas as in `--replicas`).

Each pipeline is a replica: its stages, its k micro-batches in flight (`micro_batches`), its routing
weight (its goodput's share) and, as `predicted`, what the online model says at its routed rate: p90
TTFT and p90 TPOT, and its goodput in tokens/s. So the top-level `predicted.throughput_tok_s` is the
plan's goodput x mean output tokens, where `tessel simulate --goodput` starts its search. The
workload is written at the planned rate (or the rate the simulator confirmed, when the caller gives
one), with the plan's total micro-batches M and size b in flight (`latency_estimate_s` =
(M b - 1/2) / rate, so that Little's law gives back M b requests): the simulator's `plan` regime
reads them.
"""

from __future__ import annotations

from tessel.plan.files.plan_file import PlanFile
from tessel.plan.files.workload import Workload
from tessel.plan.online.latency import predict_p90
from tessel.plan.online.online_plan import OnlinePlan
from tessel.plan.report import plan_json, stage_records


def planned_workload(plan: OnlinePlan, workload: Workload, rate_req_s: float | None = None) -> Workload:
    """The workload at `rate_req_s` (default: the planned rate) with the plan's micro-batches in flight."""
    total = sum(p.micro_batches for p in plan.pipelines)
    requests = total * plan.micro_batch_size
    rate = plan.goodput_req_s if rate_req_s is None else rate_req_s
    update = {
        "arrival_rate_per_s": rate,
        "latency_estimate_s": (requests - 0.5) / rate,
        "max_micro_batch": total,
    }
    return workload.model_copy(update=update)


def replicas_records(plan: OnlinePlan, cluster) -> list[dict]:  # noqa: ANN001
    shape = plan.shape
    n_out = shape.output_mean_tokens
    records = []
    for index, (pipeline, weight) in enumerate(zip(plan.pipelines, plan.weights, strict=True)):
        at = predict_p90(pipeline.times, shape, pipeline.goodput_req_s)
        records.append(
            {
                "index": index,
                "weight": weight,
                "stages": stage_records(pipeline.instance, pipeline.evaluation, cluster),
                "predicted": {
                    "ttft_s": at.ttft_p90_s,
                    "tpot_s": at.tpot_p90_s,
                    "throughput_tok_s": pipeline.goodput_req_s * n_out,
                },
                "objective": pipeline.evaluation.objective,
                "micro_batches": pipeline.micro_batches,
            }
        )
    return records


def online_plan_file(
    plan: OnlinePlan,
    *,
    model,
    cluster,
    cluster_source: str,
    workload: Workload,
    dtype: str,
    kv_dtype: str,
    granularity: str,
    rate_req_s: float | None = None,
) -> PlanFile:  # noqa: ANN001
    """The plan file `tessel simulate --plan` reads (module docstring)."""
    first = plan.pipelines[0]
    return plan_json(
        first.instance,
        first.evaluation,
        model=model,
        cluster=cluster,
        cluster_source=cluster_source,
        workload=planned_workload(plan, workload, rate_req_s),
        solver={
            "name": "online",
            "status": f"goodput {plan.goodput_req_s:.4g} req/s",
            "paths": len(plan.pipelines),
        },
        baselines={},
        dtype=dtype,
        kv_dtype=kv_dtype,
        granularity=granularity,
        replicas=replicas_records(plan, cluster),
        baseline_instance=plan.instances[plan.micro_batch_size],
    )
