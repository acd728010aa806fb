"""The planner's Python API: `make_plan(model, cluster, workload, ...)`, what `tessel plan` runs.

    from tessel.plan.api import make_plan
    outcome = make_plan("llama-3-70b", "mixed-a100-v100-t4", "default", time_limit_s=10)
    outcome.predicted.throughput_tok_s, outcome.to_json()

`time_limit_s` bounds the whole call, not only the solver: the set-up (pricing every device pair
and unit) is timed and the solver gets what is left (at least `MIN_SOLVER_S`; the set-up of the
largest cluster a file may describe, `MAX_CLUSTER_DEVICES` GPUs, stays within seconds).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from tessel.catalog.models import ModelSpec, load_model
from tessel.cost.profile import Profile, load_profile
from tessel.errors import TesselError
from tessel.files import read_json_file
from tessel.plan.baselines import BaselineResult, run_baselines
from tessel.plan.build import build_instance, capacity_shortfall_bytes
from tessel.plan.cluster import Cluster, load_cluster
from tessel.plan.instance import PlanningInstance
from tessel.plan.replan import ReplanDecision, previous_solution, replan
from tessel.plan.report import Predicted, plan_json, predict
from tessel.plan.solve import PlanResult, solve
from tessel.plan.workload import Workload, load_workload

MAX_TIME_LIMIT_S = 24 * 3600.0  # a day: longer solver runs are a typo
MIN_SOLVER_S = 0.5  # the solver always gets this much, so a slow set-up still yields a plan


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """How to plan: the options of `tessel plan`, validated once here."""

    solver: str = "milp"
    granularity: str = "layer"
    overlap: bool = False
    swap_in: str = "charged"
    time_limit_s: float = 10.0
    mip_gap: float = 0.01
    dtype: str = "fp16"
    kv_dtype: str = "fp16"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.time_limit_s) and 0 < self.time_limit_s <= MAX_TIME_LIMIT_S):
            raise TesselError(f"time limit must be in (0, {MAX_TIME_LIMIT_S:g}] s, got {self.time_limit_s}")
        if not (math.isfinite(self.mip_gap) and 0 <= self.mip_gap < 1):
            raise TesselError(f"MIP gap must be in [0, 1), got {self.mip_gap}")


@dataclass(frozen=True, slots=True)
class PlanOutcome:
    """A solved plan with everything the report and the plan file need."""

    model: ModelSpec
    cluster: Cluster
    workload: Workload
    settings: PlanSettings
    instance: PlanningInstance
    result: PlanResult
    baselines: dict[str, BaselineResult]
    replan: ReplanDecision | None = None
    replan_from: str | None = None  # the plan file re-planned from
    replan_horizon_s: float = 0.0
    cluster_source: str = ""  # the cluster file's path, or the bundled name
    setup_s: float = 0.0  # reading files and pricing units before the solver
    total_s: float = 0.0  # the whole call

    @property
    def predicted(self) -> Predicted:
        return predict(self.instance, self.result.evaluation, self.workload.micro_batch_size)

    def to_json(self) -> dict:
        """The plan file (contract version 1) that `chunk`, `simulate` and the runtime read."""
        result = self.result
        return plan_json(
            self.instance,
            result.evaluation,
            model=self.model,
            cluster=self.cluster,
            cluster_source=self.cluster_source,
            workload=self.workload,
            solver={
                "name": result.solver,
                "status": result.status,
                "gap": result.gap,
                "time_s": result.time_s,
            },
            baselines=self.baselines,
            dtype=self.settings.dtype,
            kv_dtype=self.settings.kv_dtype,
            granularity=self.settings.granularity,
        )

    def vllm_export(self):  # -> tessel.plan.export_vllm.VllmExport
        """The launch command of unmodified vLLM for this plan, with its KV capacity check."""
        from tessel.plan.export_vllm import export_vllm

        return export_vllm(
            self.instance,
            self.result.evaluation,
            model=self.model,
            dtype=self.settings.dtype,
            kv_dtype=self.settings.kv_dtype,
            max_model_len=self.workload.max_kv_tokens,
            tokens_needed=self.kv_tokens_needed,
        )

    @property
    def kv_tokens_needed(self) -> int:
        """KV tokens the workload keeps in flight: m micro-batches of b requests at full length."""
        return self.instance.micro_batches * self.workload.micro_batch_size * self.workload.max_kv_tokens


def make_plan(
    model: str | Path | ModelSpec = "llama-3-70b",
    cluster: str | Path | Cluster = "mixed-a100-v100-t4",
    workload: str | Path | Workload = "default",
    settings: PlanSettings | None = None,
    *,
    profiles: list[str | Path | Profile] | tuple = (),
    replan_from: str | Path | None = None,
    replan_threshold: float = 0.05,
    replan_horizon_s: float = 3600.0,
) -> PlanOutcome:
    """Plan a model on a cluster under a workload; names, paths or loaded specs are all accepted."""
    started = time.perf_counter()
    settings = settings or PlanSettings()
    model_spec = model if isinstance(model, ModelSpec) else load_model(model)
    cluster_spec = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    workload_spec = workload if isinstance(workload, Workload) else load_workload(workload)
    loaded = [p if isinstance(p, Profile) else load_profile(p) for p in profiles]
    previous = None if replan_from is None else read_json_file(replan_from, "--replan-from plan file")
    instance = build_instance(
        model_spec,
        cluster_spec,
        workload_spec,
        granularity=settings.granularity,
        dtype=settings.dtype,
        kv_dtype=settings.kv_dtype,
        overlap=settings.overlap,
        swap_in=settings.swap_in,
        profiles=loaded,
    )
    _check_capacity(instance)
    setup_s = time.perf_counter() - started
    solver_s = max(settings.time_limit_s - setup_s, MIN_SOLVER_S)
    decision = None
    if previous is None:
        result = solve(instance, solver=settings.solver, time_limit_s=solver_s, mip_gap=settings.mip_gap)
    else:
        if not isinstance(previous, dict):
            raise TesselError(f"--replan-from {replan_from}: expected a plan object")
        decision = replan(
            instance,
            cluster_spec,
            previous_solution(instance, previous, str(replan_from)),
            threshold=replan_threshold,
            horizon_s=replan_horizon_s,
            solver=settings.solver,
            time_limit_s=solver_s,
            mip_gap=settings.mip_gap,
        )
        result = decision.chosen
    baselines = run_baselines(instance)
    source = (
        str(cluster) if not isinstance(cluster, Cluster) and Path(cluster).exists() else cluster_spec.name
    )
    return PlanOutcome(
        model_spec,
        cluster_spec,
        workload_spec,
        settings,
        instance,
        result,
        baselines,
        decision,
        None if replan_from is None else str(replan_from),
        replan_horizon_s,
        source,
        setup_s,
        time.perf_counter() - started,
    )


def _check_capacity(instance: PlanningInstance) -> None:
    shortfall = capacity_shortfall_bytes(instance)
    if shortfall > 0:
        raise TesselError(
            f"the model does not fit: it needs {shortfall / 2**30:.1f} GiB more than all GPU and host memory "
            "of the cluster; add GPUs or host memory, use a smaller dtype, or shorten the workload"
        )
