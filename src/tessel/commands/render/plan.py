"""What `tessel plan` prints: the re-planning verdict, the stages, the prediction, the baselines."""

from __future__ import annotations

import typer
from rich.console import Console

from tessel.plan.api import PlanOutcome
from tessel.plan.report import (
    comparison_table,
    decode_utilization,
    idle_devices_line,
    kv_preemption_line,
    stage_table,
    steady_state_line,
)


def print_plan(console: Console, outcome: PlanOutcome) -> None:
    if outcome.replan is not None:
        print_replan(console, outcome)
    instance, result, b = outcome.instance, outcome.result, outcome.workload.micro_batch_size
    title = (
        f"{outcome.model.name} on {outcome.cluster.name} ({len(outcome.cluster.devices)} GPUs), workload "
        f"{outcome.workload.name}: m={instance.micro_batches} micro-batches of {b}, "
        f"{outcome.settings.granularity} granularity"
    )
    utilizations = decode_utilization(
        instance,
        result.evaluation,
        model=outcome.model,
        cluster=outcome.cluster,
        batch_size=b,
        decode_context=outcome.workload.mean_decode_context_tokens,
        dtype=outcome.settings.dtype,
        kv_dtype=outcome.settings.kv_dtype,
    )
    console.print(stage_table(instance, result.evaluation, title, utilizations))
    kv_line = kv_preemption_line(result.evaluation)
    if kv_line is not None:
        console.print(kv_line, highlight=False)
    idle_line = idle_devices_line(instance, result.evaluation)
    if idle_line is not None:
        console.print(idle_line, highlight=False)
    predicted = outcome.predicted
    gap = "n/a" if result.gap is None else f"{result.gap * 100:.2f}%"
    if outcome.model.encoder:
        console.print(encoder_text(outcome), highlight=False)
    else:
        console.print(
            f"predicted: TTFT {predicted.ttft_s:.3f} s, TPOT {predicted.tpot_s * 1e3:.2f} ms, "
            f"throughput {predicted.throughput_tok_s:.1f} tok/s; "
            f"objective {result.evaluation.objective:.3f} s"
        )
        steady = steady_state_line(
            predicted.steady_state_tok_s,
            predicted.throughput_tok_s,
            [(instance.micro_batches, result.evaluation)],
        )
        if steady is not None:
            console.print(steady, highlight=False)
    console.print(f"solver: {result.solver}, status {result.status}, gap {gap}, {result.time_s:.2f} s")
    if outcome.tp is not None:
        console.print(tp_text(outcome), highlight=False)
    console.print(
        comparison_table(outcome.base_instance or instance, result.evaluation, outcome.baselines, b)
    )


def tp_text(outcome: PlanOutcome) -> str:
    """The degrees chosen, the search over groupings and the best pipeline-only plan beside it."""
    tp, b = outcome.tp, outcome.workload.micro_batch_size
    degrees = ", ".join(str(d) for d in tp.degrees)
    bound = "n/a" if tp.gap is None else f"{tp.gap * 100:.2f}%"
    scope = "every grouping" if tp.complete else "one degree per machine (too many groupings)"
    text = (
        f"tensor parallelism: stage degrees {degrees}; searched {scope}: {tp.solved} planned, "
        f"{tp.skipped} ruled out by their bound"
        + (f", {tp.out_of_time} not reached in the time limit" if tp.out_of_time else "")
        + f"; gap over all degrees {bound}"
    )
    if tp.pipeline_only is None:
        return text + "; no pipeline-only plan fits"
    from tessel.plan.report import predict

    pp = predict(outcome.base_instance, tp.pipeline_only.evaluation, b)
    now = outcome.predicted
    return text + (
        f"\npipeline-only (--max-tp 1): TPOT {pp.tpot_s * 1e3:.2f} ms, throughput {pp.throughput_tok_s:.1f} "
        f"tok/s; this plan: TPOT {pp.tpot_s / now.tpot_s:.2f}x lower, throughput "
        f"{now.throughput_tok_s / pp.throughput_tok_s:.2f}x"
    )


def encoder_text(outcome: PlanOutcome) -> str:
    """An encoder's prediction: embeddings per second, one pass per request (no TTFT/TPOT to give;
    the tables' tok/s column is sequences/s for it)."""
    from tessel.plan.encoder import encoder_prediction

    evaluation = outcome.result.evaluation
    found = encoder_prediction(
        outcome.model,
        outcome.workload,
        outcome.instance.micro_batches,
        evaluation.prefill_makespan_s,
        sum(stage.time_prefill_s for stage in evaluation.stages),
    )
    truncated = f", prompts truncated at {outcome.model.max_position_embeddings}" if found.truncated else ""
    return (
        f"predicted (encoder, one forward per request): {found.sequences_per_s:.1f} sequences/s, "
        f"{found.tokens_per_s:.0f} tokens/s at {found.mean_tokens:.0f} tokens each{truncated}; one "
        f"micro-batch {found.batch_latency_s * 1e3:.1f} ms through the pipeline; objective "
        f"{evaluation.objective:.3f} s (tok/s below: sequences/s)"
    )


def print_replan(console: Console, outcome: PlanOutcome) -> None:
    decision = outcome.replan
    old = decision.previous_evaluation
    old_text = f"{old.objective:.3f} s" if old.feasible else "does not fit"
    console.print(
        f"re-planning from {outcome.replan_from}: previous plan {old_text}; new plan "
        f"{decision.new.evaluation.objective:.3f} s with its move ({decision.move_bytes / 2**30:.1f} GiB of "
        f"weights, {decision.move_s:.2f} s, amortised over {outcome.replan_horizon_s:.0f} s)",
        highlight=False,
    )
    if decision.precision_changes:
        console.print(f"new plan re-quantises: {precision_change_text(outcome)}", highlight=False)
    elif decision.previous.precisions is not None:
        console.print("new plan keeps every layer's precision", highlight=False)
    verdict = "taking the new plan" if decision.take_new else "keeping the previous plan"
    console.print(f"{verdict}: {decision.reason}", highlight=False)


def precision_change_text(outcome: PlanOutcome) -> str:
    """'layers 3-5 fp16 -> int8; layer 9 int8 -> fp16' (units at sublayer granularity)."""
    units = outcome.instance.units
    sublayer = outcome.settings.granularity == "sublayer"
    parts = []
    for change in outcome.replan.precision_changes:
        first, last = change.unit_start, change.unit_end - 1
        if sublayer:
            where = f"unit {first}" if first == last else f"units {first}-{last}"
        else:
            first, last = units[first].layer, units[last].layer
            where = f"layer {first}" if first == last else f"layers {first}-{last}"
        parts.append(f"{where} {change.old} -> {change.new}")
    return "; ".join(parts)


def print_vllm_export(console: Console, outcome: PlanOutcome) -> None:
    exported = outcome.vllm_export()
    console.print("vLLM launch command:")
    typer.echo(exported.command)
    console.print(
        f"vLLM KV capacity: {exported.kv_capacity_tokens} tokens "
        f"(set by stage {exported.kv_limiting_stage}); "
        f"the workload keeps {outcome.kv_tokens_needed} in flight"
    )
    for warning in exported.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)


def print_vllm_replica(  # noqa: ANN001 (the planner's instance, evaluation, problem, settings, workload)
    console: Console, title: str, instance, evaluation, problem, settings, workload
) -> None:
    """The vLLM launch command of one replica (or flow path) of a plan, under `title`, and its warnings."""
    from tessel.plan.files.export_vllm import export_vllm

    exported = export_vllm(
        instance,
        evaluation,
        model=problem.model,
        dtype=settings.dtype,
        kv_dtype=settings.kv_dtype,
        max_model_len=workload.max_kv_tokens,
    )
    console.print(title)
    typer.echo(exported.command)
    for warning in exported.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False)
