"""`tessel simulate`: run a plan (and its baselines) through the discrete-event simulator."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from tessel.cost.profile import Profile, load_profile
from tessel.errors import TesselError
from tessel.plan.plan_file import PlanFile, PlanVariant, load_plan
from tessel.sim.cpp import cpp_chunk_sizer
from tessel.sim.gantt import FORMATS as GANTT_FORMATS
from tessel.sim.gantt import plot_gantt
from tessel.sim.metrics import Metrics, compute_metrics
from tessel.sim.plan_pipeline import kv_capacity_tokens, pipeline_for
from tessel.sim.regime import REGIMES, regime_defaults
from tessel.sim.requests import Request
from tessel.sim.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, SimSchedulerConfig
from tessel.sim.simulator import MIX_RULES, SimConfig, SimResult
from tessel.sim.simulator import simulate as run_simulation
from tessel.sim.workload import requests_for_workload


def simulate(
    plan: Path = typer.Option(..., "--plan", help="Plan JSON written by `tessel plan --json`."),
    workload: str = typer.Option(
        "default", "--workload", help="Bundled workload name, a workload YAML, or a trace (.csv/.jsonl)."
    ),
    requests: int | None = typer.Option(
        None, "--requests", help="Number of requests (default 200; a trace: its first N rows)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the arrivals and lengths."),
    rate: float | None = typer.Option(None, "--rate", help="Override the workload's arrival rate (req/s)."),
    gantt: Path | None = typer.Option(None, "--gantt", help="Write a Gantt chart of the plan (.png/.svg)."),
    gantt_until_s: float | None = typer.Option(None, "--gantt-until-s", help="Cut the chart at this time."),
    json_out: Path | None = typer.Option(None, "--json", help="Write all metrics as JSON."),
    compare: bool = typer.Option(False, "--compare", help="Also simulate the plan's feasible baselines."),
    regime: str = typer.Option(
        "plan",
        "--regime",
        help="plan: the regime the planner priced (m pinned micro-batch slots, m x b sequences, KV "
        "limited to the plan's kv_gib); continuous: one shared pool, 256 sequences, one micro-batch per "
        "stage in flight (vLLM V1). The flags below override either.",
    ),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", help="Sequences admitted at once."),
    max_num_batched_tokens: int | None = typer.Option(
        None, "--max-num-batched-tokens", help="Token budget per micro-batch (default 2048)."
    ),
    max_running: int | None = typer.Option(None, "--max-running", hidden=True),  # old --max-num-seqs
    max_batch_tokens: int | None = typer.Option(None, "--max-batch-tokens", hidden=True),  # old spelling
    max_in_flight: int | None = typer.Option(
        None, "--max-in-flight", help="Micro-batches in the pipeline at once."
    ),
    enable_chunked_prefill: bool = typer.Option(True, "--chunked-prefill/--no-chunked-prefill"),
    cpp: bool = typer.Option(False, "--cpp", help="Cut prompts with the CPP chunk planner, pipelined."),
    kv_limit: bool | None = typer.Option(
        None,
        "--kv-limit/--no-kv-limit",
        help="Admit requests only while their KV fits what the plan reserved (kv_gib).",
    ),
    pinned: bool | None = typer.Option(
        None, "--pinned/--no-pinned", help="Pin each request to one in-flight slot (vLLM V0 virtual engines)."
    ),
    mix: str = typer.Option("sum", "--mix", help="Cost of a mixed prefill+decode batch: sum or max."),
    profile: list[Path] = typer.Option(
        [], "--profile", help="Profile JSON from `tessel profile` (repeatable)."
    ),
) -> None:
    """Simulate serving a workload with a plan: TTFT, TPOT, throughput, stage use, bubbles."""
    if mix not in MIX_RULES:
        raise TesselError(f"--mix must be one of {', '.join(MIX_RULES)}, got {mix!r}")
    if regime not in REGIMES:
        raise TesselError(f"--regime must be one of {', '.join(REGIMES)}, got {regime!r}")
    max_num_seqs = max_num_seqs if max_num_seqs is not None else max_running
    max_num_batched_tokens = max_num_batched_tokens or max_batch_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    for name, value in (
        ("--max-num-seqs", max_num_seqs),
        ("--max-num-batched-tokens", max_num_batched_tokens),
    ):
        if value is not None and value < 1:
            raise TesselError(f"{name} must be >= 1, got {value}")
    if max_in_flight is not None and max_in_flight < 1:
        raise TesselError(f"--max-in-flight must be >= 1, got {max_in_flight}")
    if gantt is not None and gantt.suffix.lower() not in GANTT_FORMATS:
        formats = ", ".join(GANTT_FORMATS)
        raise TesselError(f"--gantt {gantt}: unknown format {gantt.suffix!r} (use {formats})")
    plan_file = load_plan(plan)
    plan_file.check_named_cluster()
    profiles = [load_profile(path) for path in profile]
    trace = requests_for_workload(workload, requests, seed, rate)
    defaults = regime_defaults(plan_file, regime)
    scheduler = dict(
        max_num_seqs=defaults.max_num_seqs if max_num_seqs is None else max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        pipelined_prefill=cpp,
    )
    variants = [plan_file.main, *(plan_file.baseline_variants if compare else ())]
    options = {
        "max_in_flight": defaults.max_in_flight if max_in_flight is None else max_in_flight,
        "mix": mix,
        "pinned": defaults.pinned if pinned is None else pinned,
        "kv_limit": "if-known" if kv_limit is None and defaults.kv_limit else bool(kv_limit),
    }
    runs = [_run_variant(plan_file, v, trace.requests, scheduler, options, profiles) for v in variants]
    if plan_file.replicas:  # the plan is several pipelines: route the trace across them
        runs[0] = _run_replicas(plan_file, trace.requests, scheduler, options, profiles)
    console = Console()
    console.print(
        f"plan [bold]{plan}[/bold]: {plan_file.model_name} on {plan_file.cluster_name}, "
        f"{len(plan_file.main.stages)} stages; workload {trace.description}; regime {regime}: "
        f"{scheduler['max_num_seqs']} sequences, "
        f"{options['max_in_flight'] or 'one per stage'} micro-batches in flight"
        f"{', pinned' if options['pinned'] else ''}{', KV limited' if options['kv_limit'] else ''}",
        highlight=False,
    )
    console.print(_metrics_table(runs))
    console.print(_stage_table(runs[0]))
    if compare and plan_file.infeasible:
        for name, reason in plan_file.infeasible.items():
            console.print(f"baseline {name}: not simulated ({reason})", highlight=False)
    if gantt is not None:
        variant, result = runs[0][0], runs[0][1]
        plot_gantt(
            result,
            gantt,
            title=f"{plan_file.model_name} on {plan_file.cluster_name}: {trace.description}",
            stage_labels=[stage.label for stage in variant.stages],
            until_s=gantt_until_s,
        )
        console.print(f"Gantt chart written to {gantt}", highlight=False)
    if json_out is not None:
        document = {
            "version": 1,
            "plan": str(plan),
            "workload": workload,
            "description": trace.description,
            "requests": len(trace.requests),
            "seed": seed,
            "config": {
                **scheduler,
                **options,
                "regime": regime,
                "profiles": [str(p) for p in profile],
            },
            "results": {
                variant.name: {
                    "stages": [stage.label for stage in variant.stages],
                    "predicted": variant.predicted,
                    "metrics": metrics.to_json(),
                }
                for variant, _, metrics in runs
            },
        }
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(_finite(document), indent=2) + "\n")
        console.print(f"metrics written to {json_out}", highlight=False)


Run = tuple[PlanVariant, SimResult, Metrics]


def _run_variant(
    plan_file: PlanFile,
    variant: PlanVariant,
    requests: list[Request],
    scheduler: dict,
    options: dict,
    profiles: list[Profile],
) -> Run:
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
    pipeline = priced.pipeline
    chunk_sizes = None
    if scheduler["pipelined_prefill"]:  # --cpp
        chunk_sizes = cpp_chunk_sizer(pipeline, max_chunk_tokens=scheduler["max_num_batched_tokens"])
    config = SimConfig(
        SimSchedulerConfig(**scheduler, chunk_sizes=chunk_sizes, kv_capacity_tokens=capacity),
        **options,
        logits_time_s=priced.logits_time_s,
        offload_s=priced.offload_s,
        offload_overlap=priced.offload_overlap,
    )
    result = run_simulation(pipeline, requests, config)
    return variant, result, compute_metrics(result)


def _run_replicas(plan_file: PlanFile, requests, scheduler: dict, options: dict, profiles) -> Run:
    """Each replica simulated with the requests routed to it (`tessel.sim.routing`), merged."""
    from tessel.sim.routing import merge_results, route

    replicas = plan_file.replica_variants
    routed = route(requests, [r.weight for r in plan_file.replicas])
    results = [
        _run_variant(plan_file, variant, share, scheduler, options, profiles)[1]
        for variant, share in zip(replicas, routed, strict=True)
        if share
    ]
    merged = merge_results(results)
    stages = tuple(stage for variant in replicas for stage in variant.stages)
    variant = PlanVariant(name="replicas", stages=stages, predicted={})
    return variant, merged, compute_metrics(merged)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1e3:,.1f}"


def _metrics_table(runs: list[Run]) -> Table:
    table = Table(title="Simulated serving metrics")
    table.add_column("metric")
    for variant, _, _ in runs:
        table.add_column(variant.name, justify="right")
    rows: list[tuple[str, list[str]]] = []
    for label, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s")):
        for stat in ("p50", "p90", "p99", "mean"):
            rows.append((f"{label} {stat} (ms)", [_ms(getattr(getattr(m, key), stat)) for _, _, m in runs]))
    rows += [
        ("throughput (tok/s)", [f"{m.throughput_tok_s:,.1f}" for _, _, m in runs]),
        ("throughput (req/s)", [f"{m.throughput_req_s:,.3f}" for _, _, m in runs]),
        ("makespan (s)", [f"{m.makespan_s:,.3f}" for _, _, m in runs]),
        ("bubble fraction", [f"{m.bubble_fraction:.1%}" for _, _, m in runs]),
        ("stage utilisation min-max", [_util_range(m.stage_utilisation) for _, _, m in runs]),
        ("micro-batches", [str(m.batches) for _, _, m in runs]),
    ]
    predicted = [
        ("planner TTFT (ms)", "ttft_s", _ms),
        ("planner TPOT (ms)", "tpot_s", _ms),
        ("planner throughput (tok/s)", "throughput_tok_s", lambda v: f"{v:,.1f}"),
    ]
    for label, key, fmt in predicted:
        if any(key in variant.predicted for variant, _, _ in runs):
            rows.append((label, [fmt(v.predicted[key]) if key in v.predicted else "-" for v, _, _ in runs]))
    for label, values in rows:
        table.add_row(label, *values)
    return table


def _util_range(utilisation: tuple[float, ...]) -> str:
    return f"{min(utilisation):.0%}-{max(utilisation):.0%}"


def _stage_table(run: Run) -> Table:
    variant, _, metrics = run
    table = Table(title=f"Stages of {variant.name}")
    for name in ("stage", "device", "GPU", "layers", "busy (s)", "utilisation"):
        table.add_column(name, justify="right" if name in ("busy (s)", "utilisation") else "left")
    for stage, busy, use in zip(variant.stages, metrics.stage_busy_s, metrics.stage_utilisation, strict=True):
        table.add_row(
            str(stage.index),
            stage.device,
            stage.gpu_type,
            f"{stage.layer_start}-{stage.layer_end - 1}",
            f"{busy:,.3f}",
            f"{use:.1%}",
        )
    return table


def _finite(value: object) -> object:
    """JSON has no NaN: undefined statistics (TPOT of one-token outputs) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value
