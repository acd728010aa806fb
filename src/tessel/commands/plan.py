"""`tessel plan`: which layers go on which GPU, in which order, what spills to host memory.

Builds the planning instance from a model, a cluster and a workload (bundled names or files),
solves it (MILP warm-started by the DP by default), prints the stages, the predicted TTFT / TPOT /
throughput and the speedup over the baselines, and optionally writes the plan JSON and a vLLM
launch command. No torch needed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from tessel.errors import TesselError


def plan(
    model: str = typer.Option("llama-3-70b", help="Model preset name or a local HF config.json / directory."),
    cluster: str = typer.Option("mixed-a100-v100-t4", help="Bundled cluster name or a cluster YAML file."),
    workload: str = typer.Option("default", help="Bundled workload name or a workload YAML file."),
    solver: str = typer.Option("milp", help="milp (DP warm start + HiGHS), dp, or brute (tiny problems)."),
    granularity: str = typer.Option("layer", help="layer, or sublayer (attention and MLP blocks apart)."),
    overlap: bool = typer.Option(
        False, "--overlap", help="Stage time = max(compute, comm, offload), not the sum."
    ),
    swap_in: str = typer.Option(
        "charged",
        "--swap-in",
        help="charged: offloaded bytes cost their transfer in the stage time; hidden: also require the "
        "swap-in to fit under the upstream stage's work (the seed's rule; no offloading on the first stage).",
    ),
    time_limit: float = typer.Option(10.0, "--time-limit", help="Solver time limit in seconds."),
    mip_gap: float = typer.Option(0.01, "--mip-gap", help="Relative gap at which the solver stops."),
    dtype: str = typer.Option("fp16", help="Weight dtype: fp16, bf16, int8, fp8, fp32."),
    kv_dtype: str = typer.Option("fp16", "--kv-dtype", help="KV cache dtype."),
    profile: list[Path] = typer.Option(
        [], "--profile", help="Profile JSON from `tessel profile` (repeatable)."
    ),
    json_path: Path | None = typer.Option(None, "--json", help="Write the plan (contract version 1) here."),
    export: str | None = typer.Option(None, "--export", help="'vllm': print a vLLM launch command."),
    replan_from: Path | None = typer.Option(
        None,
        "--replan-from",
        help="A plan JSON now serving: re-plan for this workload, counting the weights a new plan moves.",
    ),
    replan_threshold: float = typer.Option(
        0.05, "--replan-threshold", help="Take a new plan only when it gains at least this fraction."
    ),
    precisions: str | None = typer.Option(
        None,
        "--precisions",
        help="Weight precisions a layer may take, e.g. fp16,int8,int4 (int8 = W8A8, int4 = W4A16); "
        "the planner picks one per layer. Default: --dtype for every layer.",
    ),
    quality_budget: float | None = typer.Option(
        None, "--quality-budget", help="Most total quality cost the precisions may have (docs/planner.md)."
    ),
    theta: float | None = typer.Option(
        None, "--theta", help="Seconds of objective per unit of quality cost (LLM-PQ's trade-off weight)."
    ),
    sensitivity: Path | None = typer.Option(
        None, "--sensitivity", help="Measured per-layer quality costs (JSON) instead of the indicator."
    ),
    replicas: str | None = typer.Option(
        None,
        "--replicas",
        help="auto or N: split the GPUs into several pipelines and route requests among them "
        "(docs/planner.md).",
    ),
    replan_horizon_s: float = typer.Option(
        3600.0,
        "--replan-horizon-s",
        help="Seconds the new plan will serve: its move cost is amortised over them.",
    ),
) -> None:
    """Plan MODEL on CLUSTER under WORKLOAD and compare with the baselines."""
    from rich.console import Console

    from tessel.catalog.models import load_model
    from tessel.cost.profile import load_profile
    from tessel.plan.baselines import run_baselines
    from tessel.plan.build import build_instance
    from tessel.plan.cluster import load_cluster
    from tessel.plan.report import comparison_table, plan_json, predict, stage_table
    from tessel.plan.solve import solve
    from tessel.plan.workload import load_workload

    if export not in (None, "vllm"):
        raise TesselError(f"--export {export!r}: only 'vllm' is supported")
    if time_limit <= 0:
        raise TesselError(f"--time-limit must be positive, got {time_limit}")
    if not 0 <= mip_gap < 1:
        raise TesselError(f"--mip-gap must be in [0, 1), got {mip_gap}")
    model_spec = load_model(model)
    cluster_spec = load_cluster(cluster)
    workload_spec = load_workload(workload)
    profiles = [load_profile(path) for path in profile]
    instance = build_instance(
        model_spec,
        cluster_spec,
        workload_spec,
        granularity=granularity,
        dtype=dtype,
        kv_dtype=kv_dtype,
        overlap=overlap,
        swap_in=swap_in,
        profiles=profiles,
        **_precision_options(model, precisions, quality_budget, theta, sensitivity),
    )
    _check_capacity(instance)
    console = Console(width=None if sys.stdout.isatty() else 150)
    if replicas is not None:
        from tessel.commands.plan_replicas import parse_replicas, plan_replicas

        options = dict(locals())  # the validated options, by name
        plan_replicas(
            console,
            instance,
            count=parse_replicas(replicas),
            model_spec=model_spec,
            cluster_spec=cluster_spec,
            cluster_source=cluster if Path(cluster).exists() else cluster_spec.name,
            workload_spec=workload_spec,
            options=options,
        )
        return
    if replan_from is None:
        result = solve(instance, solver=solver, time_limit_s=time_limit, mip_gap=mip_gap)
    else:
        result = _replan(
            console,
            instance,
            cluster_spec,
            replan_from,
            replan_threshold,
            replan_horizon_s,
            solver,
            time_limit,
            mip_gap,
        )
    baselines = run_baselines(instance)

    b = workload_spec.micro_batch_size
    title = (
        f"{model_spec.name} on {cluster_spec.name} ({instance.n_devices} GPUs), workload "
        f"{workload_spec.name}: m={instance.micro_batches} micro-batches of {b}, {granularity} granularity"
    )
    console.print(stage_table(instance, result.evaluation, title))
    predicted = predict(instance, result.evaluation, b)
    gap = "n/a" if result.gap is None else f"{result.gap * 100:.2f}%"
    console.print(
        f"predicted: TTFT {predicted.ttft_s:.3f} s, TPOT {predicted.tpot_s * 1e3:.2f} ms, "
        f"throughput {predicted.throughput_tok_s:.1f} tok/s; objective {result.evaluation.objective:.3f} s"
    )
    console.print(f"solver: {result.solver}, status {result.status}, gap {gap}, {result.time_s:.2f} s")
    console.print(comparison_table(instance, result.evaluation, baselines, b))

    if json_path is not None:
        solver_info = {
            "name": result.solver,
            "status": result.status,
            "gap": result.gap,
            "time_s": result.time_s,
        }
        plan_file = plan_json(
            instance,
            result.evaluation,
            model=model_spec,
            cluster=cluster_spec,
            cluster_source=cluster if Path(cluster).exists() else cluster_spec.name,
            workload=workload_spec,
            solver=solver_info,
            baselines=baselines,
            dtype=dtype,
            kv_dtype=kv_dtype,
            granularity=granularity,
        )
        plan_file.write(json_path)
        console.print(f"wrote {json_path}")
    if export == "vllm":
        from tessel.plan.export_vllm import export_vllm

        needed = instance.micro_batches * b * workload_spec.max_kv_tokens
        exported = export_vllm(
            instance,
            result.evaluation,
            model=model_spec,
            dtype=dtype,
            kv_dtype=kv_dtype,
            max_model_len=workload_spec.max_kv_tokens,
            tokens_needed=needed,
        )
        console.print("vLLM launch command:")
        typer.echo(exported.command)
        console.print(
            f"vLLM KV capacity: {exported.kv_capacity_tokens} tokens "
            f"(set by stage {exported.kv_limiting_stage}); "
            f"the workload keeps {needed} in flight"
        )
        for warning in exported.warnings:
            console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)


def _replan(console, instance, cluster, path: Path, threshold, horizon_s, solver, time_limit, mip_gap):
    from tessel.plan.plan_file import load_plan
    from tessel.plan.replan import previous_solution, replan

    previous = load_plan(path)
    previous.check_cluster(cluster)
    decision = replan(
        instance,
        cluster,
        previous_solution(instance, previous.stages, str(path)),
        threshold=threshold,
        horizon_s=horizon_s,
        solver=solver,
        time_limit_s=time_limit,
        mip_gap=mip_gap,
    )
    old = decision.previous_evaluation
    old_text = f"{old.objective:.3f} s" if old.feasible else "does not fit"
    new_objective = decision.new.evaluation.objective
    console.print(
        f"re-planning from {path}: previous plan {old_text}; new plan {new_objective:.3f} s "
        f"with its move ({decision.move_bytes / 2**30:.1f} GiB of weights, {decision.move_s:.2f} s, "
        f"amortised over {horizon_s:.0f} s)",
        highlight=False,
    )
    verdict = "taking the new plan" if decision.take_new else "keeping the previous plan"
    console.print(f"{verdict}: {decision.reason}", highlight=False)
    return decision.chosen


def _precision_options(model: str, precisions, quality_budget, theta, sensitivity) -> dict:
    from tessel.plan.precision import parse_precisions

    if precisions is None:
        if quality_budget is not None or theta is not None or sensitivity is not None:
            raise TesselError("--quality-budget, --theta and --sensitivity need --precisions")
        return {}
    checkpoint = Path(model) if Path(model).is_dir() else None
    return {
        "precisions": parse_precisions(precisions),
        "quality_budget": quality_budget,
        "theta": theta,
        "checkpoint": checkpoint,
        "sensitivity": sensitivity,
    }


def _check_capacity(instance) -> None:
    from tessel.plan.build import capacity_shortfall_bytes

    shortfall = capacity_shortfall_bytes(instance)
    if shortfall > 0:
        raise TesselError(
            f"the model does not fit: it needs {shortfall / 2**30:.1f} GiB more than all GPU and host memory "
            "of the cluster; add GPUs or host memory, use a smaller dtype, or shorten the workload"
        )
