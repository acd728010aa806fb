"""`tessel plan --replicas auto` when a flow plan wins: its paths, placements and flow weights,
its plan file (version 4, `flow`) and the closest vLLM export. The planning is
`tessel.plan.flow.flow_choice.choose_with_flow`."""

from __future__ import annotations

import math
from pathlib import Path

import typer


def print_flow(console, instance, choice) -> None:
    from rich.table import Table

    plan = choice.flow
    table = Table(
        title=f"flow plan: {len(plan.paths)} paths over {len(plan.stages)} GPUs", title_justify="left"
    )
    for column in ("path", "GPUs", "micro-batches", "tok/s", "routing weight", "devices"):
        table.add_column(column, justify="right")
    for index, path in enumerate(plan.paths):
        names = " > ".join(instance.devices[d].name for d in path.devices)
        table.add_row(
            str(index),
            str(len(path.devices)),
            str(path.micro_batches),
            f"{path.throughput_tok_s:.1f}",
            f"{path.weight:.3f}",
            names,
        )
    console.print(table)
    line = flow_steady_state_line(instance, plan)
    if line is not None:
        console.print(line, highlight=False)
    placements = Table(title="placements (each GPU's layers)", title_justify="left")
    for column in ("device", "type", "layers", "paths through it"):
        placements.add_column(column, justify="right")
    for s in plan.stages:
        through = sum(s.device in p.devices for p in plan.paths)
        placements.add_row(
            instance.devices[s.device].name,
            instance.devices[s.device].gpu_type,
            f"{instance.units[s.unit_start].layer}-{instance.units[s.unit_end - 1].layer}",
            str(through),
        )
    console.print(placements)


def flow_steady_state_line(instance, plan) -> str | None:  # noqa: ANN001 (instance, FlowPlan)
    """The flow plan's steady-state prediction (`tessel.plan.steady_state.steady_state_tok_s` per path,
    capped by the queueing where a path shares a GPU) beside its objective's figure."""
    from tessel.plan.report import routed_tok_s, steady_state_line

    figures = [p.steady_state_tok_s for p in plan.paths]
    if any(y is None for y in figures):
        return None
    steady = routed_tok_s(figures, [p.weight for p in plan.paths])
    pipelines = [(p.micro_batches, path_pipeline(instance, plan, p)[1]) for p in plan.paths]
    return steady_state_line(steady, plan.throughput_tok_s, pipelines)


def print_comparison(console, choice) -> None:
    replicas, search = choice.replicas, choice.search
    flow_tok = None if search is None or search.plan is None else search.plan.throughput_tok_s
    gap = choice.gap
    console.print(
        f"chosen: {choice.kind}, {choice.throughput_tok_s:.1f} tok/s; one pipeline "
        f"{replicas.single_tok_s:.1f}, disjoint replicas {replicas.throughput_tok_s:.1f}, best flow plan "
        f"{'n/a' if flow_tok is None else f'{flow_tok:.1f}'} tok/s; memory bound "
        f"{choice.bound_tok_s:.1f} tok/s (gap {'n/a' if gap is None else f'{gap * 100:.1f}%'}), "
        f"{choice.time_s:.1f} s"
    )
    line = pipelines_bound_line(choice)
    if line is not None:
        console.print(line)


def pipelines_bound_line(choice) -> str | None:  # noqa: ANN001 (a FlowChoice)
    """The tighter bound over disjoint pipelines (pipeline fill counted) and what the plan reaches."""
    bound = choice.pipelines_bound_tok_s
    if not math.isfinite(bound) or bound <= 0:
        return None
    if choice.offloads:
        reach = "the plan offloads to host memory, which this bound does not cover"
    elif not choice.disjoint:
        reach = "the plan shares GPUs between paths, which this bound does not cover"
    else:
        reach = f"the plan reaches {choice.throughput_tok_s / bound * 100:.1f}% of it"
    return f"bound over disjoint pipelines (fill and compositions counted): {bound:.1f} tok/s; {reach}"


def path_pipeline(instance, plan, path):  # noqa: ANN001, ANN201
    """A flow path as a pipeline of its own: (its sub-instance, the evaluation of its stages there)."""
    from tessel.plan.instance import gpu_memory_only, subset, with_micro_batches
    from tessel.plan.solution import Solution, Stage, evaluate

    sub = with_micro_batches(gpu_memory_only(subset(instance, path.devices)), path.micro_batches)
    local = Solution(tuple(Stage(i, plan.stage_of(d).unit_start, plan.stage_of(d).unit_end)
                           for i, d in enumerate(path.devices)))  # fmt: skip
    return sub, evaluate(sub, local)


def write_and_export(console, problem, choice, settings, json_path: Path | None, export: str | None) -> None:
    from tessel.plan.report import flow_json, plan_json
    from tessel.plan.solvers.baselines import run_baselines

    instance, cluster_spec = problem.instance, problem.cluster
    plan = choice.flow
    paths, flow = flow_json(instance, plan, cluster_spec, problem.workload.micro_batch_size)
    workload_spec = problem.workload.with_in_flight(plan.micro_batches)
    if json_path is not None:
        plan_file = plan_json(
            *path_pipeline(instance, plan, plan.paths[0]),
            model=problem.model,
            cluster=cluster_spec,
            cluster_source=problem.cluster_source,
            workload=workload_spec,
            solver={
                "name": "flow-milp",
                "status": "best of pipelines, replicas and flow",
                "paths": len(paths),
            },
            baselines=run_baselines(instance),
            dtype=settings.dtype,
            kv_dtype=settings.kv_dtype,
            granularity=settings.granularity,
            replicas=paths,
            quality_source=instance.labels.get("quality_source", "shape"),
            baseline_instance=instance,
            flow=flow,
        )
        plan_file.write(json_path)
        console.print(f"wrote {json_path}")
    if export == "vllm":
        _export_vllm(console, problem, plan, settings, workload_spec)


def _export_vllm(console, problem, plan, settings, workload_spec) -> None:
    from tessel.commands.render.plan import print_vllm_replica
    from tessel.plan.files.export_vllm import closest_disjoint_paths

    taken, weights, warnings = closest_disjoint_paths(plan)
    for warning in warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
    for index, weight in zip(taken, weights, strict=True):
        title = f"vLLM replica for path {index} (load-balancer weight {weight:.3f}):"
        sub, evaluation = path_pipeline(problem.instance, plan, plan.paths[index])
        print_vllm_replica(console, title, sub, evaluation, problem, settings, workload_spec)
    typer.echo("load-balancer weights: " + ",".join(f"{w:.4f}" for w in weights))
