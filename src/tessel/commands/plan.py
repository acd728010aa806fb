"""`tessel plan`: which layers go on which GPU, in which order, what spills to host memory.

Options in (typer checks ranges, choices and paths), `tessel.plan.api.make_plan` does the work,
`tessel.commands.render.plan` prints it. No torch needed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import typer

from tessel.commands.options import (
    FORCE_PROFILE_OPTION,
    float_option,
    input_file,
    optional_float,
    output_file,
    plan_dtype_option,
)
from tessel.dtypes import KV_DTYPE_HELP, parse_dtype
from tessel.errors import TesselError
from tessel.plan.api import MAX_TIME_LIMIT_S, MIN_TIME_LIMIT_S
from tessel.plan.build import MAX_QUALITY_BUDGET, MAX_THETA
from tessel.plan.files.plan_parts import MAX_TP_DEGREE


def _kv_dtype(value: str) -> str:  # typer callbacks take the value alone
    try:
        return parse_dtype(value, runtime=False, kv=True)
    except TesselError as error:
        raise typer.BadParameter(str(error)) from None


KV_DTYPE_OPTION = typer.Option(
    "fp16", "--kv-dtype", callback=_kv_dtype, metavar="DTYPE", help=f"KV cache dtype: {KV_DTYPE_HELP}."
)


def plan(
    model: str = typer.Option("llama-3-70b", help="Model preset name or a local HF config.json / directory."),
    cluster: str = typer.Option(
        "mixed-a100-v100-t4",
        help="Bundled cluster name, a cluster YAML file, 'ray': the running Ray cluster's machines and "
        "their measured links (`tessel probe --ray`), or 'local': this machine's GPUs and CPU "
        "(what `tessel probe` finds).",
    ),
    gpu_memory_gib: float | None = optional_float(
        "--gpu-memory-gib",
        low=0.01,
        high=2.0**20,
        help="Use at most this many GiB of each GPU for the model (weights, KV cache, activations); "
        "with --cluster local the rest goes to the CPU.",
    ),
    workload: str = typer.Option("default", help="Bundled workload name or a workload YAML file."),
    solver: Literal["milp", "dp", "brute"] = typer.Option(
        "milp", help="milp (DP warm start + HiGHS), dp, or brute (tiny problems)."
    ),
    granularity: Literal["layer", "sublayer"] = typer.Option(
        "layer", help="layer, or sublayer (attention and MLP blocks apart)."
    ),
    overlap: bool = typer.Option(
        False, "--overlap", help="Stage time = max(compute, comm, offload), not the sum."
    ),
    swap_in: Literal["charged", "hidden"] = typer.Option(
        "charged",
        "--swap-in",
        help="charged: offloaded bytes cost their transfer in the stage time; hidden: also require the "
        "swap-in to fit under the upstream stage's work (the seed's rule; no offloading on the first stage).",
    ),
    kv_preemption: Literal["auto", "off"] = typer.Option(
        "auto",
        "--kv-preemption",
        help="auto: KV a stage evicts under memory pressure comes back by swap or recompute, the cheaper "
        "on its device (printed per stage); off: it streams in like offloaded weights. "
        "Priced with --swap-in charged only.",
    ),
    time_limit: float = float_option(
        10.0,
        "--time-limit",
        low=MIN_TIME_LIMIT_S,
        high=MAX_TIME_LIMIT_S,
        floor_reason="the solver always gets that long",
        help="Seconds for the whole command.",
    ),
    mip_gap: float = float_option(0.01, "--mip-gap", low=0.0, high=0.999, help="Relative gap to stop at."),
    dtype: str = plan_dtype_option("fp16", "--dtype", help="Weight dtype"),
    kv_dtype: str = KV_DTYPE_OPTION,
    profile: list[Path] = input_file(
        [], "--profile", help="Profile JSON from `tessel profile` (repeatable)."
    ),
    force_profile: bool = FORCE_PROFILE_OPTION,
    json_path: Path | None = output_file(
        None, "--json", help="Write the plan file (tessel.plan.files.plan_file) here."
    ),
    export: Literal["vllm"] | None = typer.Option(
        None, "--export", help="'vllm': print a vLLM launch command."
    ),
    replan_from: Path | None = input_file(
        None,
        "--replan-from",
        help="A plan JSON now serving: re-plan for this workload, counting the weights a new plan moves.",
    ),
    replan_threshold: float = float_option(
        0.05,
        "--replan-threshold",
        low=0.0,
        high=1.0,
        help="Take a new plan only when it gains this fraction.",
    ),
    precisions: str | None = typer.Option(
        None,
        "--precisions",
        help="Weight precisions a layer may take, e.g. fp16,int8,int4 (int8 = W8A8, int4 = W4A16); "
        "the planner picks one per layer. Default: --dtype for every layer.",
    ),
    quality_budget: float | None = optional_float(
        "--quality-budget",
        low=0.0,
        high=MAX_QUALITY_BUDGET,
        help="Most total quality cost the precisions may have (docs/planner.md).",
    ),
    theta: float | None = optional_float(
        "--theta",
        low=0.0,
        high=MAX_THETA,
        help="Seconds of objective per unit of quality cost (LLM-PQ's trade-off weight).",
    ),
    sensitivity: Path | None = input_file(
        None, "--sensitivity", help="Measured per-layer quality costs (JSON) instead of the indicator."
    ),
    replicas: str | None = typer.Option(
        None,
        "--replicas",
        help="auto or N: split the GPUs into several pipelines and route requests among them "
        "(docs/planner.md).",
    ),
    replan_horizon_s: float = float_option(
        3600.0,
        "--replan-horizon-s",
        low=1.0,
        high=1e9,
        help="Seconds the new plan serves (amortises its move).",
    ),
    concurrency: Literal["auto", "fixed", "memory"] = typer.Option(
        "auto",
        "--concurrency",
        help="Requests in flight: fixed (the workload's micro-batches, for latency-bound serving), memory "
        "(each pipeline carries as many as its GPU memory holds, for offline work; implies --replicas 1 "
        "when --replicas is not given), auto (memory for an offline workload with --replicas, else fixed).",
    ),
    max_concurrency: int | None = typer.Option(
        None,
        "--max-concurrency",
        min=1,
        help="With concurrency by memory: at most this many requests in flight.",
    ),
    objective: Literal["latency", "goodput"] = typer.Option(
        "latency",
        "--objective",
        help="latency: one request's time with the workload's micro-batches in flight; goodput: the most "
        "requests/s within the workload's `slo` (p90 TTFT / TPOT), checked by the simulator.",
    ),
    max_tp: int | None = typer.Option(
        None,
        "--max-tp",
        min=1,
        max=MAX_TP_DEGREE,
        help="Most GPUs of one machine a stage may span with tensor parallelism (1, 2, 4, 8; default: the "
        "largest a machine allows). 1: pipeline-only plans, every stage one GPU.",
    ),
) -> None:
    """Plan MODEL on CLUSTER under WORKLOAD and compare with the baselines."""
    from rich.console import Console

    from tessel.commands.render.plan import print_plan, print_vllm_export
    from tessel.files import check_output_path
    from tessel.plan.api import PlanSettings, make_plan, prepare_plan

    if replicas is not None and replan_from is not None:
        raise TesselError("--replicas cannot re-plan from a serving plan; drop --replan-from")
    if json_path is not None:
        inputs = (model, cluster, workload, *profile, replan_from, sensitivity)
        check_output_path(json_path, "--json", inputs=inputs)  # never over a file this command reads
    cluster_arg = planning_cluster(cluster, gpu_memory_gib)  # refusals before any pricing
    settings = PlanSettings(
        solver,
        granularity,
        overlap,
        swap_in,
        time_limit,
        mip_gap,
        dtype,
        kv_dtype,
        precisions,
        quality_budget,
        theta,
        sensitivity,
        kv_preemption,
        force_profile,
        first_node=ray_first_node(cluster, cluster_arg),
        max_tp=max_tp,
    )
    console = Console(width=None if sys.stdout.isatty() else 150)
    if objective == "goodput":
        from tessel.commands.plan_online import plan_goodput

        if replicas is not None or replan_from is not None or export is not None:
            raise TesselError(
                "--objective goodput chooses its own pipelines; drop --replicas, --replan-from, --export"
            )
        plan_goodput(console, model, cluster_arg, workload, settings, profile, json_path)
        return
    if concurrency == "memory" and replicas is None:
        replicas = "1"
    if max_concurrency is not None and (replicas is None or concurrency == "fixed"):
        raise TesselError("--max-concurrency applies with --concurrency memory (or --replicas, offline)")
    if replicas is not None:
        from tessel.commands.plan_replicas import parse_replicas, plan_replicas

        problem = prepare_plan(model, cluster_arg, workload, settings, profile)
        if concurrency == "auto":
            concurrency = "memory" if problem.workload.batch_size is not None else "fixed"
        plan_replicas(
            console,
            problem,
            parse_replicas(replicas),
            settings,
            json_path,
            export,
            concurrency=concurrency,
            max_concurrency=max_concurrency,
        )
        return
    outcome = make_plan(
        model,
        cluster_arg,
        workload,
        settings,
        profiles=profile,
        replan_from=replan_from,
        replan_threshold=replan_threshold,
        replan_horizon_s=replan_horizon_s,
    )
    print_plan(console, outcome)
    if json_path is not None:
        outcome.plan_file().write(json_path)
        console.print(f"wrote {json_path}")
    if export == "vllm":
        print_vllm_export(console, outcome)


def ray_first_node(cluster: str, spec) -> str | None:  # noqa: ANN001 (str | Cluster)
    """With --cluster ray: this machine, where a Ray pipeline's stage 0 runs (`tessel probe --ray`
    lists it first), so the plan's first stage is put there; None otherwise."""
    from tessel.plan.files.cluster import RAY_CLUSTER

    return spec.nodes[0].name if cluster == RAY_CLUSTER else None


def planning_cluster(cluster: str, gpu_memory_gib: float | None):  # noqa: ANN201 (str | Cluster)
    """What `make_plan` gets for --cluster: the name or path as given, this machine for 'local', and a
    loaded cluster with each GPU's memory capped under --gpu-memory-gib."""
    from tessel.commands.probe import LOCAL_CLUSTER, local_cluster, ray_cluster
    from tessel.plan.files.cluster import RAY_CLUSTER, cap_gpu_memory, load_cluster

    if cluster not in (LOCAL_CLUSTER, RAY_CLUSTER) and gpu_memory_gib is None:
        return cluster
    discovered = {LOCAL_CLUSTER: local_cluster, RAY_CLUSTER: ray_cluster}.get(cluster)
    spec = discovered() if discovered is not None else load_cluster(cluster)
    return spec if gpu_memory_gib is None else cap_gpu_memory(spec, gpu_memory_gib, "--gpu-memory-gib")
