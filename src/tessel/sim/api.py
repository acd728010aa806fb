"""The simulator's Python API: `simulate_plan(plan, workload, ...)`, what `tessel simulate` runs.

    from tessel.sim.api import SimulationSettings, simulate_plan
    report = simulate_plan("plan.json", "default", SimulationSettings(requests=200, compare=True))
    report.runs[0].metrics.ttft_s.p50, report.to_json()

Settings left at None take the serving regime's defaults (`tessel.sim.regime`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tessel.chunk.from_plan import plan_profiles
from tessel.cost.profile import Profile
from tessel.errors import TesselError
from tessel.plan.files.plan_file import PlanFile, load_plan
from tessel.plan.files.plan_parts import PlanVariant
from tessel.plan.remap.remap_decision import RemapSettings
from tessel.sim.cpp import cpp_chunk_sizer
from tessel.sim.plan_pipeline import SimPipeline, kv_capacity_tokens, pipeline_for
from tessel.sim.regime import REGIMES, regime_defaults
from tessel.sim.remap import SimulatedRemap, simulated_remap
from tessel.sim.request_trace import RequestSet, requests_for_workload
from tessel.sim.requests import Request
from tessel.sim.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, SimSchedulerConfig
from tessel.sim.sim_metrics import Metrics, compute_metrics
from tessel.sim.simulator import MIX_RULES, SimConfig, SimResult, simulate, slowdowns_for

MAX_BATCH_TOKENS = 2**24  # token budget per micro-batch: beyond any prompt (tessel.chunk.planner)
MAX_SEQUENCES = 1_000_000  # --max-num-seqs / --max-in-flight upper bound


@dataclass(frozen=True, slots=True)
class SimulationSettings:
    """The options of `tessel simulate`; None takes the regime's default."""

    requests: int | None = None  # default 200; a trace: its first N rows
    seed: int = 0
    rate_per_s: float | None = None
    compare: bool = False  # also the plan's feasible baselines
    regime: str = "plan"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_in_flight: int | None = None
    enable_chunked_prefill: bool = True
    cpp: bool = False
    kv_limit: bool | None = None
    pinned: bool | None = None
    mix: str = "sum"
    remap: RemapSettings | None = None  # also run the server's remap decision on the plan's run

    def __post_init__(self) -> None:
        _check_one_of("mix", self.mix, MIX_RULES)
        _check_one_of("regime", self.regime, REGIMES)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_in_flight"):
            value = getattr(self, name)
            limit = MAX_BATCH_TOKENS if name == "max_num_batched_tokens" else MAX_SEQUENCES
            if value is not None and not 1 <= value <= limit:
                raise TesselError(f"{name} must be from 1 to {limit}, got {value}")


def _check_one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise TesselError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True, slots=True)
class VariantRun:
    variant: PlanVariant
    result: SimResult
    metrics: Metrics


@dataclass(frozen=True, slots=True)
class SimulationReport:
    plan_file: PlanFile
    workload: str
    trace: RequestSet
    settings: SimulationSettings
    scheduler: dict  # the SimSchedulerConfig fields the runs used, regime defaults applied
    options: dict  # the SimConfig fields the runs used
    runs: tuple[VariantRun, ...]  # the plan first, then the baselines
    profiles: tuple[str, ...] = ()
    remap: SimulatedRemap | None = None  # the remap decisions on the plan's run (settings.remap)

    def to_json(self) -> dict:
        remap = {} if self.remap is None else {"remap": self.remap.to_json()}
        return {
            **remap,
            "version": 1,
            "plan": str(self.plan_file.path),
            "workload": self.workload,
            "description": self.trace.description,
            "requests": len(self.trace.requests),
            "seed": self.settings.seed,
            "config": {
                **self.scheduler,
                **self.options,
                "regime": self.settings.regime,
                "profiles": list(self.profiles),
            },
            "results": {
                run.variant.name: {
                    "stages": [stage.label for stage in run.variant.stages],
                    "predicted": run.variant.predicted,
                    "metrics": run.metrics.to_json(),
                    **_kv_restores_json(run.result),
                }
                for run in self.runs
            },
        }


def _kv_restores_json(result: SimResult) -> dict:
    """Per stage, the evicted KV it brought back and how (only when some stage evicts KV)."""
    if not any(result.kv_restores):
        return {}
    return {"kv_restores": [None if stats is None else stats.to_json() for stats in result.kv_restores]}


def simulate_plan(
    plan: str | Path | PlanFile,
    workload: str = "default",
    settings: SimulationSettings | None = None,
    *,
    profiles: tuple[str | Path, ...] | list = (),
    trace: RequestSet | None = None,
    force_profile: bool = False,
) -> SimulationReport:
    """Serve a workload (bundled name, workload YAML or trace file) with a plan and its baselines;
    `trace`, when given, is served instead of the workload's requests (`workload` then only names it).
    A profile of another device type, model shape or tessel is refused unless `force_profile`."""
    settings = settings or SimulationSettings()
    plan_file = plan if isinstance(plan, PlanFile) else load_plan(plan)
    plan_file.check_named_cluster()
    if plan_file.model_spec.encoder:  # one forward per request: no decode steps to schedule
        raise TesselError(
            f"{plan_file.model_name} is an encoder (one forward per request, no decode): `tessel simulate` "
            "schedules decoder requests; the plan's sequences/s is the encoder's prediction"
        )
    loaded = plan_profiles(plan_file, profiles, force_profile)
    if trace is None:
        trace = requests_for_workload(workload, settings.requests, settings.seed, settings.rate_per_s)
    defaults = regime_defaults(plan_file, settings.regime)
    scheduler = {
        "max_num_seqs": defaults.max_num_seqs if settings.max_num_seqs is None else settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "enable_chunked_prefill": settings.enable_chunked_prefill,
        "pipelined_prefill": settings.cpp,
    }
    kv_limit = settings.kv_limit
    options = {
        "max_in_flight": defaults.max_in_flight if settings.max_in_flight is None else settings.max_in_flight,
        "mix": settings.mix,
        "pinned": defaults.pinned if settings.pinned is None else settings.pinned,
        "kv_limit": "if-known" if kv_limit is None and defaults.kv_limit else bool(kv_limit),
    }
    variants = [plan_file.main, *(plan_file.baseline_variants if settings.compare else ())]
    runs = [_run_variant(plan_file, v, trace.requests, scheduler, options, loaded) for v in variants]
    if plan_file.replicas:  # the plan is several pipelines: route the trace across them
        runs[0] = _run_replicas(plan_file, trace.requests, scheduler, options, loaded, settings)
    runs = tuple(runs)
    names = tuple(str(p) for p in profiles if not isinstance(p, Profile))
    remap = None
    if settings.remap is not None:
        if plan_file.replicas:
            raise TesselError(f"{plan_file.path}: --remap decides for one pipeline; this plan has replicas")
        remap = simulated_remap(plan_file, runs[0].result, trace.requests, settings.remap)
    return SimulationReport(plan_file, str(workload), trace, settings, scheduler, options, runs, names, remap)


def _run_variant(
    plan_file: PlanFile,
    variant: PlanVariant,
    requests: list[Request],
    scheduler: dict,
    options: dict,
    profiles: list[Profile],
) -> VariantRun:
    priced, config = _variant_config(plan_file, variant, scheduler, options, profiles)
    result = simulate(priced.pipeline, requests, config)
    return VariantRun(variant, result, compute_metrics(result))


def _variant_config(
    plan_file: PlanFile, variant: PlanVariant, scheduler: dict, options: dict, profiles: list[Profile]
) -> tuple[SimPipeline, SimConfig]:
    """The variant's priced pipeline and the simulator's settings for it."""
    options = dict(options)
    capacity = None
    kv_limit = options.pop("kv_limit")
    if kv_limit:
        capacity = kv_capacity_tokens(plan_file, variant)
        if capacity is None and kv_limit != "if-known":
            raise TesselError(
                f"--kv-limit: {variant.name} in {plan_file.path} gives no kv_gib for its stages"
            )
    priced = pipeline_for(plan_file, variant, profiles)
    slowdowns = tuple(slowdowns_for(s.emulate_speed, s.emulate_schedule) for s in variant.stages)
    chunk_sizes = None
    if scheduler["pipelined_prefill"]:  # --cpp
        chunk_sizes = cpp_chunk_sizer(priced.pipeline, max_chunk_tokens=scheduler["max_num_batched_tokens"])
    config = SimConfig(
        SimSchedulerConfig(**scheduler, chunk_sizes=chunk_sizes, kv_capacity_tokens=capacity),
        **options,
        logits_time_s=priced.logits_time_s,
        offload_s=priced.offload_s,
        offload_overlap=priced.offload_overlap,
        kv_pools=priced.kv_pools,
        slowdowns=slowdowns if any(slowdowns) else (),
        cores=priced.cores,
    )
    return priced, config


def _run_replicas(
    plan_file: PlanFile,
    requests: list[Request],
    scheduler: dict,
    options: dict,
    profiles: list[Profile],
    settings: SimulationSettings,
) -> VariantRun:
    """Each replica simulated with the requests routed to it (`tessel.sim.routing`), merged; a flow
    plan's paths that share a device queue on its one timeline (`tessel.sim.shared_devices`). A
    replica dealt no request (a short trace, a small weight) is in the result with its stages idle."""
    from tessel.sim.routing import merge_results, route
    from tessel.sim.shared_devices import SharedPath, simulate_shared
    from tessel.sim.simulator import SimResult

    replicas = plan_file.replica_variants
    routed = route(requests, [r.weight for r in plan_file.replicas])
    paths = []
    for replica, variant, share in zip(plan_file.replicas, replicas, routed, strict=True):
        if share:
            own = _replica_settings(plan_file, replica, scheduler, options, settings)
            priced, config = _variant_config(plan_file, variant, *own, profiles)
            devices = tuple(stage.device for stage in variant.stages)
            if len(set(devices)) < len(devices):
                names = ", ".join(devices)
                raise TesselError(f"{plan_file.path}: {variant.name} visits a device twice: {names}")
            paths.append(SharedPath(priced.pipeline, config, share, devices))
    simulated = iter(simulate_shared(paths))
    results = [
        next(simulated) if share else SimResult(len(variant.stages), (), (), 0)
        for variant, share in zip(replicas, routed, strict=True)
    ]
    merged = merge_results(results)
    stages = tuple(stage for variant in replicas for stage in variant.stages)
    whole = {} if plan_file.predicted is None else plan_file.predicted.as_dict()  # the whole plan's
    return VariantRun(
        PlanVariant(name="replicas", stages=stages, predicted=whole), merged, compute_metrics(merged)
    )


def _replica_settings(
    plan_file: PlanFile, replica, scheduler: dict, options: dict, settings: SimulationSettings
) -> tuple[dict, dict]:
    """(scheduler, options) for one replica: in the plan regime it keeps its own share of
    the workload's micro-batches in flight (`Replica.micro_batches`), where no flag set them."""
    defaults = regime_defaults(plan_file, settings.regime)
    k = replica.micro_batches
    if k is None or defaults.max_in_flight is None:
        return scheduler, options
    b = defaults.max_num_seqs // defaults.max_in_flight
    scheduler, options = dict(scheduler), dict(options)
    if settings.max_num_seqs is None:
        scheduler["max_num_seqs"] = k * b
    if settings.max_in_flight is None:
        options["max_in_flight"] = k
    if settings.pinned is None:
        options["pinned"] = k > 1
    return scheduler, options
