"""What `tessel simulate` prints (metrics per plan variant, stage use) and its Gantt chart."""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tessel.plan.report import gpus_text
from tessel.sim.api import SimulationReport, VariantRun
from tessel.sim.gantt import default_window_s, plot_gantt
from tessel.sim.load import LoadCheck
from tessel.sim.measured import MetricComparison


def print_simulation(console: Console, report: SimulationReport) -> None:
    plan_file, scheduler, options = report.plan_file, report.scheduler, report.options
    console.print(
        f"plan [bold]{plan_file.path}[/bold]: {plan_file.model_name} on {plan_file.cluster_name}, "
        f"{len(plan_file.main.stages)} stages; workload {report.trace.description}; "
        f"regime {report.settings.regime}: {scheduler['max_num_seqs']} sequences, "
        f"{options['max_in_flight'] or 'one per stage'} micro-batches in flight"
        f"{', pinned' if options['pinned'] else ''}{', KV limited' if options['kv_limit'] else ''}",
        highlight=False,
    )
    console.print(metrics_table(report.runs))
    console.print(variant_stage_table(report.runs[0], run_utilization(report.plan_file, report.runs[0])))
    if report.settings.compare:
        for name, reason in plan_file.infeasible.items():
            console.print(f"baseline {name}: not simulated ({reason})", highlight=False)


def write_gantt(report: SimulationReport, path: Path, until_s: float | None = None) -> float | None:
    """The Gantt chart of the plan's run (the first variant); without `until_s`, the default window
    (`tessel.sim.gantt.default_window_s`). -> where the chart was cut (None: the whole run)."""
    run = report.runs[0]
    title = f"{report.plan_file.model_name} on {report.plan_file.cluster_name}: {report.trace.description}"
    if until_s is None:
        until_s = default_window_s(run.result)
        if until_s is not None:
            title += f" (first {until_s:,.3g} s of {run.metrics.makespan_s:,.3g} s)"
    plot_gantt(
        run.result,
        path,
        title=title,
        stage_labels=[stage.label for stage in run.variant.stages],
        until_s=until_s,
    )
    return until_s


def print_load(console: Console, load: LoadCheck | None) -> None:
    if load is not None and load.overloaded:
        console.print(f"[yellow]{escape(load.message())}[/yellow]")


def predicted_vs_measured_table(rows: list[MetricComparison], title: str) -> Table:
    """Predicted and measured side by side, with (predicted - measured) / measured."""
    table = Table(title=title)
    for name in ("metric", "predicted", "measured", "error"):
        table.add_column(name, justify="left" if name == "metric" else "right")
    for row in rows:
        fmt = _ms if row.unit == "ms" else (lambda v: "-" if math.isnan(v) else f"{v:,.1f}")
        error = "-" if math.isnan(row.error) else f"{row.error:+.1%}"
        table.add_row(f"{row.label} ({row.unit})", fmt(row.predicted), fmt(row.measured), error)
    return table


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1e3:,.1f}"


def metrics_table(runs: tuple[VariantRun, ...]) -> Table:
    table = Table(title="Simulated serving metrics")
    table.add_column("metric")
    for run in runs:
        table.add_column(run.variant.name, justify="right")
    metrics = [run.metrics for run in runs]
    rows: list[tuple[str, list[str]]] = []
    for label, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s")):
        for stat in ("p50", "p90", "p99", "mean"):
            rows.append((f"{label} {stat} (ms)", [_ms(getattr(getattr(m, key), stat)) for m in metrics]))
    rows += [
        ("throughput (tok/s)", [f"{m.throughput_tok_s:,.1f}" for m in metrics]),
        ("throughput (req/s)", [f"{m.throughput_req_s:,.3f}" for m in metrics]),
        ("makespan (s)", [f"{m.makespan_s:,.3f}" for m in metrics]),
        ("bubble fraction", [f"{m.bubble_fraction:.1%}" for m in metrics]),
        ("stage utilisation min-max", [_util_range(m.stage_utilisation) for m in metrics]),
        ("micro-batches", [str(m.batches) for m in metrics]),
    ]
    predicted = [
        ("planner TTFT (ms)", "ttft_s", _ms),
        ("planner TPOT (ms)", "tpot_s", _ms),
        ("planner throughput (tok/s)", "throughput_tok_s", lambda v: f"{v:,.1f}"),
    ]
    variants = [run.variant for run in runs]
    for label, key, fmt in predicted:
        if any(key in v.predicted for v in variants):
            rows.append((label, [fmt(v.predicted[key]) if key in v.predicted else "-" for v in variants]))
    for label, values in rows:
        table.add_row(label, *values)
    return table


def _util_range(utilisation: tuple[float, ...]) -> str:
    return f"{min(utilisation):.0%}-{max(utilisation):.0%}"


def run_utilization(plan_file, run: VariantRun) -> list:  # noqa: ANN001 (PlanFile)
    """Each stage's predicted MFU and MBU over its busy time (`tessel.sim.utilization`)."""
    from tessel.sim.utilization import stage_utilization

    return stage_utilization(plan_file, run.variant.stages, run.result, run.metrics.stage_busy_s)


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 100:.1f}"


def variant_stage_table(run: VariantRun, utilizations: list | None = None) -> Table:
    """Per stage: where it runs, its layers, how busy the simulation kept it; and the weight
    precisions it was priced at when the plan gives them; with `utilizations`, MFU and MBU."""
    from tessel.plan.precision.precision import stage_precision_text

    table = Table(title=f"Stages of {run.variant.name}")
    mixed = any(stage.precisions is not None for stage in run.variant.stages)
    names = (
        "stage",
        "device",
        "GPU",
        "layers",
        *(("precisions",) if mixed else ()),
        "busy (s)",
        "utilisation",
    )
    if utilizations is not None:
        names = (*names, "MFU %", "MBU %")
    restores = run.result.kv_restores
    if any(restores):  # stages that evict KV: how it came back (tessel.sim.kv_pool)
        names = (*names, "KV restored", "restore (s)")
    for name in names:
        right = name in ("busy (s)", "utilisation", "MFU %", "MBU %", "restore (s)")
        table.add_column(name, justify="right" if right else "left")
    metrics = run.metrics
    for index, (stage, busy, use) in enumerate(
        zip(run.variant.stages, metrics.stage_busy_s, metrics.stage_utilisation, strict=True)
    ):
        util = () if utilizations is None else (utilizations[index].mfu, utilizations[index].mbu)
        precisions = tuple(stage.precisions or ())
        table.add_row(
            str(stage.index),
            gpus_text(stage.rank_gpus) + (f" (TP {stage.tp_degree})" if stage.tp_degree > 1 else ""),
            stage.gpu_type,
            f"{stage.layer_start}-{stage.layer_end - 1}",
            *((stage_precision_text(precisions, 0, len(precisions)),) if mixed else ()),
            f"{busy:,.3f}",
            f"{use:.1%}",
            *(_percent(value) for value in util),
            *(_restore_cells(restores[index]) if any(restores) else ()),
        )
    return table


def _restore_cells(stats) -> tuple[str, str]:  # noqa: ANN001 (KvRestoreStats | None)
    if stats is None:
        return "-", "-"
    return f"{stats.mode} {stats.tokens:,} tok", f"{stats.seconds:,.3f}"
