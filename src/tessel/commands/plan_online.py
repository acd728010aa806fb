"""`tessel plan --objective goodput`: the plan serving the most requests/s within the workload's SLOs
(`tessel.plan.online.online_plan.plan_online`), held against the simulator at the planned rate.

The simulator then serves `CONFIRM_REQUESTS` Poisson requests of the workload at the planned rate
(seed `CONFIRM_SEED`) and checks both p90s; when it misses them it searches down to half that rate
(`tessel.sim.slo.confirm_rate`, at most 6 runs); the rate it confirms is printed beside the plan's
and is the rate the plan file's workload carries (`--json`).
A workload asking for more than any plan held in GPU memory serves at all (the memory bound over
every plan, `tessel.plan.solvers.memory_bound`, at the largest micro-batch tried, with no SLO) is
refused, exit 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tessel.errors import TesselError

if TYPE_CHECKING:
    from tessel.plan.files.plan_file import PlanFile
    from tessel.plan.online.online_plan import OnlinePlan
    from tessel.sim.slo import Goodput

CONFIRM_REQUESTS = 300
CONFIRM_SEED = 0
CEILING_S = 20.0  # HiGHS time for the memory bound's LP at most


@dataclass(frozen=True, slots=True)
class GoodputOutcome:
    plan: OnlinePlan
    plan_file: PlanFile  # what --json writes
    confirmed: Goodput  # the simulator's check of the planned rate
    ceiling_req_s: float | None  # computed only when the workload asks for more than the goodput


def plan_goodput(console, model: str, cluster, workload: str, settings, profiles, json_path: Path | None):  # noqa: ANN001, ANN201
    """Plan, print, confirm by simulation, write (`--json`)."""
    from tessel.catalog.models import load_model
    from tessel.commands.render.plan_online import print_confirmation, print_online
    from tessel.plan.files.cluster import Cluster, load_cluster
    from tessel.plan.files.workload import load_workload
    from tessel.plan.online.online_file import online_plan_file
    from tessel.plan.online.online_plan import OnlineSettings, online_workload, plan_online

    if settings.precisions is not None:
        raise TesselError("--objective goodput plans one weight dtype; drop --precisions")
    workload_spec = load_workload(workload)
    online_workload(workload_spec)  # refused before any pricing
    model_spec = load_model(model)
    cluster_spec = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    options = settings.instance_options(model)
    online = OnlineSettings(time_limit_s=settings.time_limit_s, solver=settings.solver)
    plan = plan_online(model_spec, cluster_spec, workload_spec, online, profiles=list(profiles), **options)
    ceiling = None
    if workload_spec.arrival_rate_per_s > plan.goodput_req_s:
        ceiling = ceiling_req_s(plan)
        if workload_spec.arrival_rate_per_s > ceiling:
            raise TesselError(too_fast(workload_spec, cluster_spec.name, ceiling, plan))
    source = (
        str(cluster) if not isinstance(cluster, Cluster) and Path(cluster).exists() else cluster_spec.name
    )
    plan_file = online_plan_file(
        plan, model=model_spec, cluster=cluster_spec, cluster_source=source, workload=workload_spec,
        dtype=settings.dtype, kv_dtype=settings.kv_dtype, granularity=settings.granularity,
    )  # fmt: skip
    print_online(console, plan, workload_spec, cluster_spec, ceiling)
    confirmed = confirm(plan_file, workload_spec, plan)
    print_confirmation(console, plan, confirmed)
    if 0 < confirmed.rate_req_s < plan.goodput_req_s:  # the file serves the rate the simulator confirmed
        plan_file = online_plan_file(
            plan, model=model_spec, cluster=cluster_spec, cluster_source=source, workload=workload_spec,
            dtype=settings.dtype, kv_dtype=settings.kv_dtype, granularity=settings.granularity,
            rate_req_s=confirmed.rate_req_s,
        )  # fmt: skip
    if json_path is not None:
        plan_file.write(json_path)
        console.print(f"wrote {json_path}")
    return GoodputOutcome(plan, plan_file, confirmed, ceiling)


def too_fast(workload, cluster: str, ceiling: float, plan) -> str:  # noqa: ANN001
    return (
        f"workload {workload.name} asks for {workload.arrival_rate_per_s:g} requests/s; no plan of "
        f"{cluster} held in GPU memory serves more than {ceiling:.4g} requests/s even without SLOs (memory "
        f"bound at micro-batches of up to {max(plan.instances)}), and within the SLOs the best plan serves "
        f"{plan.goodput_req_s:.4g}; lower arrival_rate_per_s or add GPUs"
    )


def ceiling_req_s(plan) -> float:  # noqa: ANN001
    """Requests/s no plan held in GPU memory serves, SLOs or not: the memory bound at the largest b."""
    from tessel.plan.solvers.memory_bound import memory_flow_bound

    b = max(plan.instances)
    bound = memory_flow_bound(plan.instances[b], b, time_limit_s=CEILING_S)
    return bound.throughput_tok_s / plan.shape.output_mean_tokens


def confirm(plan_file, workload, plan, requests: int = CONFIRM_REQUESTS, seed: int = CONFIRM_SEED):  # noqa: ANN001, ANN201
    """The simulator's check of the planned rate, and lower rates if it misses (`find_goodput`)."""
    from tessel.sim.api import SimulationSettings, simulate_plan
    from tessel.sim.request_trace import requests_from
    from tessel.sim.slo import Slo, confirm_rate

    def run_at(rate: float):  # noqa: ANN202
        trace = requests_from(workload, requests, seed, rate)
        settings = SimulationSettings(requests=requests, seed=seed, rate_per_s=rate)
        return simulate_plan(plan_file, workload.name, settings, trace=trace).runs[0].metrics

    return confirm_rate(run_at, plan.goodput_req_s, Slo(*plan.slo))
