"""`tessel plan --replicas auto|N`: several pipelines, the routing weights, their plan file and
one vLLM command per replica. The planning is `tessel.plan.replicas.replicas.choose_replicas`."""

from __future__ import annotations

from pathlib import Path

import typer

from tessel.errors import TesselError


def parse_replicas(text: str) -> int | None:
    """'auto' -> None (choose the count), else a positive count."""
    if text.strip().lower() == "auto":
        return None
    try:
        count = int(text)
    except ValueError:
        raise TesselError(f"--replicas {text!r}: use 'auto' or a count >= 1") from None
    if count < 1:
        raise TesselError(f"--replicas {text!r}: use 'auto' or a count >= 1")
    return count


def plan_replicas(
    console,
    problem,
    count: int | None,
    settings,
    json_path: Path | None,
    export: str | None,
    *,
    concurrency: str = "fixed",
    max_concurrency: int | None = None,
):
    """Choose, print, write (`--json`) and export (`--export vllm`) a replica plan.

    `problem` is `tessel.plan.api.prepare_plan`'s result, `settings` its `PlanSettings`."""
    from rich.table import Table

    from tessel.commands.plan_flow import print_comparison, print_flow, write_and_export
    from tessel.plan.flow.flow_choice import choose_with_flow
    from tessel.plan.replicas.replicas import ReplicaSettings, replica_gap, split_gap
    from tessel.plan.report import (
        plan_json,
        predict,
        replicas_json,
        routed_tok_s,
        stage_table,
        steady_state_line,
    )
    from tessel.plan.solvers.baselines import run_baselines

    instance, cluster_spec, workload_spec = problem.instance, problem.cluster, problem.workload
    b = workload_spec.micro_batch_size
    solver_s = problem.solver_time_s(settings)
    choice = choose_with_flow(
        instance,
        b,
        ReplicaSettings(
            replicas=count,
            solver=settings.solver,
            time_limit_s=solver_s,
            mip_gap=settings.mip_gap,
            concurrency=concurrency,
            max_micro_batches=None if max_concurrency is None else max(1, max_concurrency // b),
        ),
    )
    chosen = choice.replicas
    if choice.flow is not None:  # a flow plan serves more than any pipeline or replica split
        print_flow(console, instance, choice)
        print_comparison(console, choice)
        write_and_export(console, problem, choice, settings, json_path, export)
        return choice
    if choice.search is not None:
        print_comparison(console, choice)
    elif count is None and concurrency == "memory" and instance.precision is None:
        console.print(_flow_not_searched(instance, solver_s))
    for index, replica in enumerate(chosen.replicas):
        title = (
            f"replica {index}: weight {replica.weight:.3f}, {len(replica.devices)} GPUs, "
            f"{replica.micro_batches} of the {instance.micro_batches} micro-batches in flight"
        )
        if chosen.concurrency == "memory":
            title = (
                f"replica {index}: weight {replica.weight:.3f}, {len(replica.devices)} GPUs, "
                f"{replica.micro_batches} micro-batches of {b} in flight (as its memory holds)"
            )
        console.print(stage_table(replica.instance, replica.result.evaluation, title))
    table = Table(title=f"{len(chosen.replicas)} replicas on {cluster_spec.name}", title_justify="left")
    for column in ("replica", "GPUs", "types", "micro-batches", "tok/s", "routing weight", "status", "gap"):
        table.add_column(column, justify="right")
    for index, replica in enumerate(chosen.replicas):
        types = sorted({replica.instance.devices[j].gpu_type for j in range(len(replica.devices))})
        gap = "n/a" if replica.result.gap is None else f"{replica.result.gap * 100:.2f}%"
        table.add_row(
            str(index),
            str(len(replica.devices)),
            ",".join(types),
            str(replica.micro_batches),
            f"{replica.throughput_tok_s:.1f}",
            f"{replica.weight:.3f}",
            replica.result.status,
            gap,
        )
    console.print(table)
    gap, every = replica_gap(chosen), split_gap(chosen)
    console.print(
        f"replicas: {chosen.throughput_tok_s:.1f} tok/s in all (max flow over the replicas), "
        f"{chosen.splits_evaluated} splits tried{' (every partition)' if chosen.exhaustive else ''}, "
        f"gap {'n/a' if gap is None else f'{gap * 100:.2f}%'} to this split's bound, "
        f"{'n/a' if every is None else f'{every * 100:.2f}%'} to the bound over every split "
        f"({chosen.split_bound_tok_s:.1f} tok/s), {chosen.time_s:.1f} s"
    )
    steady = [predict(r.instance, r.result.evaluation, b).steady_state_tok_s for r in chosen.replicas]
    line = steady_state_line(
        routed_tok_s(steady, [r.weight for r in chosen.replicas]),
        chosen.throughput_tok_s,
        [(r.micro_batches, r.result.evaluation) for r in chosen.replicas],
    )
    if line is not None:
        console.print(line, highlight=False)
    console.print(
        f"concurrency: {chosen.concurrency}; the whole cluster as one pipeline at the workload's "
        f"{instance.micro_batches} micro-batches: {chosen.single_tok_s:.1f} tok/s "
        f"(the plan above is never less)"
    )
    workload_spec = workload_spec.with_in_flight(sum(r.micro_batches for r in chosen.replicas))
    first = chosen.replicas[0]
    if json_path is not None:
        plan_file = plan_json(
            first.instance,
            first.result.evaluation,
            model=problem.model,
            cluster=cluster_spec,
            cluster_source=problem.cluster_source,
            workload=workload_spec,
            solver={
                "name": first.result.solver,
                "status": first.result.status,
                "replicas": len(chosen.replicas),
            },
            baselines=run_baselines(instance),
            dtype=settings.dtype,
            kv_dtype=settings.kv_dtype,
            granularity=settings.granularity,
            replicas=replicas_json(chosen, cluster_spec, b),
            quality_source=instance.labels.get("quality_source", "shape"),
            baseline_instance=instance,
        )
        plan_file.write(json_path)
        console.print(f"wrote {json_path}")
    if export == "vllm":
        from tessel.commands.render.plan import print_vllm_replica

        for index, replica in enumerate(chosen.replicas):
            title = f"vLLM replica {index} (load-balancer weight {replica.weight:.3f}):"
            evaluation = replica.result.evaluation
            print_vllm_replica(console, title, replica.instance, evaluation, problem, settings, workload_spec)
        weights = ",".join(f"{replica.weight:.4f}" for replica in chosen.replicas)
        typer.echo(f"load-balancer weights (replica 0..{len(chosen.replicas) - 1}): {weights}")
    return chosen


def _flow_not_searched(instance, solver_s: float) -> str:
    """Why `--replicas auto` compared no flow plan: the solvers' time was below the flow search's."""
    from tessel.plan.flow.flow_choice import FLOW_SHARE, FLOW_SHARE_LARGE, MIN_FLOW_S
    from tessel.plan.replicas.replicas import EXHAUSTIVE_DEVICES

    share = FLOW_SHARE if instance.n_devices <= EXHAUSTIVE_DEVICES else FLOW_SHARE_LARGE
    return (
        f"flow plans not searched: {solver_s:.1f} s of the time limit were left for the solvers, the "
        f"flow search needs {MIN_FLOW_S / share:.1f} s; raise --time-limit to compare them"
    )
