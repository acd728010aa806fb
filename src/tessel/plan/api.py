"""The planner's Python API: `make_plan(model, cluster, workload, ...)`, what `tessel plan` runs.

    from tessel.plan.api import PlanSettings, make_plan
    outcome = make_plan("llama-3-70b", "mixed-a100-v100-t4", "default", PlanSettings(time_limit_s=10))
    outcome.predicted.throughput_tok_s, outcome.plan_file().write("plan.json")

`time_limit_s` bounds the whole call, not only the solver: the set-up (pricing every device pair
and unit) is timed and the solver gets what is left (at least `MIN_SOLVER_S`; the set-up of the
largest cluster a file may describe, `MAX_CLUSTER_DEVICES` GPUs, stays within seconds).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tessel.catalog.models import ModelSpec, load_model
from tessel.cost.profile import Profile
from tessel.errors import TesselError
from tessel.plan.build import build_instance, capacity_shortfall_bytes
from tessel.plan.files.cluster import Cluster, load_cluster
from tessel.plan.files.plan_file import PlanFile, load_plan
from tessel.plan.files.plan_parts import MAX_TP_DEGREE
from tessel.plan.files.workload import Workload, load_workload
from tessel.plan.instance import PlanningInstance
from tessel.plan.remap.replan import ReplanDecision, check_same_model, previous_solution, replan
from tessel.plan.report import Predicted, plan_json, predict
from tessel.plan.solution import first_stage_on
from tessel.plan.solvers.baselines import BaselineResult, run_baselines
from tessel.plan.solvers.solve import PlanResult, solve
from tessel.plan.tp.search import TpPlan, solve_tp, tp_possible
from tessel.plan.tp.tp_instance import TpContext

# What the API accepts for each input: a bundled name, a file path, or the loaded spec.
ModelArg = str | Path | ModelSpec
ClusterArg = str | Path | Cluster
WorkloadArg = str | Path | Workload
Profiles = list[str | Path | Profile] | tuple

MAX_TIME_LIMIT_S = 24 * 3600.0  # a day: longer solver runs are a typo
MIN_SOLVER_S = 0.5  # the solver always gets this much, so a slow set-up still yields a plan
MIN_TIME_LIMIT_S = MIN_SOLVER_S  # a shorter limit could not be kept: the solver gets MIN_SOLVER_S


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
    precisions: str | None = None  # e.g. "fp16,int8,int4": a weight precision per layer
    quality_budget: float | None = None
    theta: float | None = None
    sensitivity: Path | None = None  # measured per-layer quality costs (JSON)
    kv_preemption: str = "auto"  # evicted KV priced by swap or recompute per stage ("off": streamed)
    force_profile: bool = False  # use a profile of another device, model shape or tessel (warned)
    first_node: str | None = None  # the node the first stage must run on (a Ray pipeline's command's)
    # most GPUs of a tensor-parallel stage (None: the largest a machine allows; 1: pipeline-only plans)
    max_tp: int | None = None

    def __post_init__(self) -> None:
        if not (
            math.isfinite(self.time_limit_s) and MIN_TIME_LIMIT_S <= self.time_limit_s <= MAX_TIME_LIMIT_S
        ):
            raise TesselError(
                f"time limit must be in [{MIN_TIME_LIMIT_S:g}, {MAX_TIME_LIMIT_S:g}] s, "
                f"got {self.time_limit_s}"
            )
        if not (math.isfinite(self.mip_gap) and 0 <= self.mip_gap < 1):
            raise TesselError(f"MIP gap must be in [0, 1), got {self.mip_gap}")
        if self.max_tp is not None and not 1 <= self.max_tp <= MAX_TP_DEGREE:
            raise TesselError(f"--max-tp must be in [1, {MAX_TP_DEGREE}], got {self.max_tp}")
        if self.precisions is None and (
            self.quality_budget is not None or self.theta is not None or self.sensitivity is not None
        ):
            raise TesselError("--quality-budget, --theta and --sensitivity need --precisions")

    @classmethod
    def of_plan(cls, plan: PlanFile, *, time_limit_s: float, solver: str = "milp") -> PlanSettings:
        """The settings a plan file records (granularity, overlap, swap-in, dtypes, its largest
        tensor-parallel degree), to plan again like it with `solver` in `time_limit_s`."""
        return cls(
            solver=solver,
            granularity=plan.granularity,
            overlap=plan.overlap,
            swap_in=plan.swap_in,
            time_limit_s=time_limit_s,
            dtype=plan.dtype,
            kv_dtype=plan.kv_dtype,
            max_tp=max(stage.tp_degree for stage in plan.stages),
        )

    def instance_options(self, model: str | Path | ModelSpec) -> dict:
        """build_instance's keyword arguments: granularity, dtypes, overlap, swap-in and precisions."""
        return {
            "granularity": self.granularity,
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "overlap": self.overlap,
            "swap_in": self.swap_in,
            "kv_preemption": self.kv_preemption,
            "force_profile": self.force_profile,
            **self.precision_options(model),
        }

    def precision_options(self, model: str | Path | ModelSpec) -> dict:
        """build_instance's precision arguments (none: --dtype for every layer)."""
        from tessel.plan.precision.precision import parse_precisions

        if self.precisions is None:
            return {}
        checkpoint = Path(model) if not isinstance(model, ModelSpec) and Path(model).is_dir() else None
        return {
            "precisions": parse_precisions(self.precisions),
            "quality_budget": self.quality_budget,
            "theta": self.theta,
            "checkpoint": checkpoint,
            "sensitivity": self.sensitivity,
        }


@dataclass(frozen=True, slots=True)
class PlanProblem:
    """The priced planning instance and what it was built from, before any solver runs."""

    model: ModelSpec
    cluster: Cluster
    workload: Workload
    instance: PlanningInstance
    cluster_source: str  # the cluster file's path, or the bundled name
    started: float  # perf_counter at the start of the call
    setup_s: float  # reading files and pricing units

    def solver_time_s(self, settings: PlanSettings) -> float:
        """What is left of the command's time limit for the solver (at least MIN_SOLVER_S)."""
        return max(settings.time_limit_s - (time.perf_counter() - self.started), MIN_SOLVER_S)


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
    tp: TpPlan | None = None  # the search over tensor-parallel degrees (None: not searched)
    base_instance: PlanningInstance | None = None  # every GPU alone (the baselines'); None: `instance`

    @property
    def predicted(self) -> Predicted:
        return predict(self.instance, self.result.evaluation, self.workload.micro_batch_size)

    def plan_file(self) -> PlanFile:
        """The plan file that `chunk`, `simulate` and the runtime read (`tessel.plan.files.plan_file`)."""
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
            quality_source=self.instance.labels.get("quality_source", "shape"),
            baseline_instance=self.base_instance,
        )

    def vllm_export(self):  # -> tessel.plan.files.export_vllm.VllmExport
        """The launch command of unmodified vLLM for this plan, with its KV capacity check."""
        from tessel.plan.files.export_vllm import export_vllm

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


def prepare_plan(
    model: ModelArg,
    cluster: ClusterArg,
    workload: WorkloadArg,
    settings: PlanSettings,
    profiles: Profiles = (),
) -> PlanProblem:
    """Read the inputs and price every unit on every device; refuse a model that cannot fit."""
    started = time.perf_counter()
    model_spec = model if isinstance(model, ModelSpec) else load_model(model)
    cluster_spec = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    workload_spec = workload if isinstance(workload, Workload) else load_workload(workload)
    instance = build_instance(  # profiles loaded and checked there (their paths named)
        model_spec, cluster_spec, workload_spec, profiles=list(profiles), **settings.instance_options(model)
    )
    _check_capacity(instance)
    source = (
        str(cluster) if not isinstance(cluster, Cluster) and Path(cluster).exists() else cluster_spec.name
    )
    return PlanProblem(
        model_spec, cluster_spec, workload_spec, instance, source, started, time.perf_counter() - started
    )


def _first_stage_on(instance: PlanningInstance, result: PlanResult, node: str) -> PlanResult:
    """`result` moved so its first stage runs on `node` (`solution.first_stage_on`); refused when
    `node` has no device, or no such plan is feasible."""
    if not any(slot.node == node for slot in instance.devices):
        raise TesselError(f"the first stage must run on node {node}, which the cluster lacks")
    pinned = first_stage_on(instance, result.solution, node)
    if pinned is None:
        raise TesselError(f"no feasible plan starts on node {node} (where stage 0 must run)")
    moved = pinned[0] != result.solution
    detail = {**result.detail, "first_stage_moved_to": node} if moved else result.detail
    return replace(result, solution=pinned[0], evaluation=pinned[1], detail=detail)


def make_plan(
    model: ModelArg = "llama-3-70b",
    cluster: ClusterArg = "mixed-a100-v100-t4",
    workload: WorkloadArg = "default",
    settings: PlanSettings | None = None,
    *,
    profiles: Profiles = (),
    replan_from: str | Path | None = None,
    replan_threshold: float = 0.05,
    replan_horizon_s: float = 3600.0,
) -> PlanOutcome:
    """Plan a model on a cluster under a workload; names, paths or loaded specs are all accepted."""
    settings = settings or PlanSettings()
    previous = None
    if replan_from is not None:
        previous = load_plan(replan_from)
        settings = inherited_precisions(settings, previous)
    problem = prepare_plan(model, cluster, workload, settings, profiles)
    instance = problem.instance
    solver_s = problem.solver_time_s(settings)
    decision = None
    tp = None
    if previous is None and tp_possible(problem.cluster, problem.model, tp_max_degree(settings)):
        tp = solve_tp(
            instance,
            TpContext(problem.model, problem.cluster, problem.workload, settings.dtype, settings.kv_dtype,
                      _loaded(profiles)),
            tp_max_degree(settings),
            solver=settings.solver,
            time_limit_s=solver_s,
            mip_gap=settings.mip_gap,
        )  # fmt: skip
        instance, result = tp.instance, tp.result
        if settings.first_node is not None:
            result = _first_stage_on(instance, result, settings.first_node)
    elif previous is None:
        result = solve(instance, solver=settings.solver, time_limit_s=solver_s, mip_gap=settings.mip_gap)
        if settings.first_node is not None:
            result = _first_stage_on(instance, result, settings.first_node)
    else:
        if any(stage.tp_degree > 1 for stage in previous.stages):
            raise TesselError(
                f"{replan_from} has tensor-parallel stages; re-planning counts weight moves per GPU of "
                "pipeline-only plans: plan afresh (without --replan-from)"
            )
        check_same_model(previous, problem.model)
        previous.check_cluster(problem.cluster)
        decision = replan(
            instance,
            problem.cluster,
            previous_solution(instance, previous.stages, str(replan_from), previous.reference_dtype),
            threshold=replan_threshold,
            horizon_s=replan_horizon_s,
            solver=settings.solver,
            time_limit_s=solver_s,
            mip_gap=settings.mip_gap,
            first_node=settings.first_node,
        )
        result = decision.chosen
    outcome = PlanOutcome(
        problem.model,
        problem.cluster,
        problem.workload,
        settings,
        instance,
        result,
        run_baselines(problem.instance),
        decision,
        None if replan_from is None else str(replan_from),
        replan_horizon_s,
        problem.cluster_source,
        problem.setup_s,
        time.perf_counter() - problem.started,
        tp,
        None if tp is None else problem.instance,
    )
    _check_slo_rate(outcome)
    return outcome


def tp_max_degree(settings: PlanSettings) -> int:
    """The most GPUs a stage may span: --max-tp, else the largest a machine allows; 1 with a weight
    precision per layer (tensor-parallel stages are priced at one precision)."""
    if settings.precisions is not None:
        return 1
    return MAX_TP_DEGREE if settings.max_tp is None else settings.max_tp


def _loaded(profiles: Profiles) -> tuple[Profile, ...]:
    """The profiles as loaded (`build_instance` has checked them already)."""
    from tessel.cost.profile import load_profile

    return tuple(p if isinstance(p, Profile) else load_profile(p) for p in profiles)


def _check_slo_rate(outcome: PlanOutcome) -> None:
    """A workload with SLOs whose arrival rate is above what the plan serves is refused (exit 2):
    requests would queue for as long as they keep coming, so no TTFT target holds. When the plan
    has fewer requests in flight than the workload allows, the fix is more in flight (Little's
    law with the plan's own request latency), and the message says how many."""
    workload = outcome.workload
    if workload.slo is None or workload.arrival_rate_per_s is None or outcome.model.encoder:
        return
    predicted, n_out = outcome.predicted, workload.output_tokens.mean_tokens
    capacity = predicted.throughput_tok_s / n_out
    rate = workload.arrival_rate_per_s
    if rate <= capacity:
        return
    latency_s = predicted.ttft_s + n_out * predicted.tpot_s
    asked = f"workload {workload.name} sends {rate:g} req/s with SLOs"
    if workload.micro_batches < workload.max_micro_batch:
        raise TesselError(
            f"{asked}, but its {workload.requests_in_flight} requests in flight (Little's law with "
            f"latency_estimate_s or the nominal TPOT) serve {capacity:.4g} req/s under this plan; at its "
            f"request latency of {latency_s:.3g} s the rate needs about {math.ceil(rate * latency_s)} in "
            f"flight: set latency_estimate_s: {latency_s:.3g} in the workload and plan again"
        )
    raise TesselError(
        f"{asked} (p90 TTFT {workload.slo.ttft_p90_s:g} s, p90 TPOT {workload.slo.tpot_p90_s:g} s), above "
        f"the {capacity:.4g} req/s the best plan serves with {workload.max_micro_batch} micro-batches in "
        "flight: requests would queue without bound; lower arrival_rate_per_s, raise max_micro_batch or "
        "add GPUs (`tessel simulate --plan P --goodput` finds the highest rate a plan serves within them)"
    )


def inherited_precisions(settings: PlanSettings, previous: PlanFile) -> PlanSettings:
    """Re-planning without --precisions: the previous plan's precisions, budget and theta, so its
    precisions are kept or re-chosen under the same rules (with --precisions: the settings as given)."""
    if settings.precisions is not None or len(previous.precisions) < 2:
        return settings
    quality = previous.quality
    if quality is None:
        return replace(settings, precisions=",".join(previous.precisions))
    if quality.source == "sensitivity" and settings.sensitivity is None:
        raise TesselError(
            f"{previous.source} chose its precisions with measured sensitivities; re-plan it with "
            f"--precisions {','.join(previous.precisions)} --sensitivity FILE (the file it was planned with)"
        )
    theta = quality.theta if quality.theta > 0 or quality.budget is None else None
    return replace(
        settings, precisions=",".join(previous.precisions), quality_budget=quality.budget, theta=theta
    )


def _check_capacity(instance: PlanningInstance) -> None:
    shortfall = capacity_shortfall_bytes(instance)
    if shortfall > 0:
        raise TesselError(
            f"the model does not fit: it needs {shortfall / 2**30:.1f} GiB more than all GPU and host memory "
            "of the cluster; add GPUs or host memory, use a smaller dtype, or shorten the workload"
        )
