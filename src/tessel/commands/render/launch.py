"""What `tessel launch` prints: the completions, one row per pipeline stage, then the measured
TTFT, TPOT and throughput under the names and units `tessel simulate` prints its predictions in."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from tessel.sim.measured import MeasuredMetrics

STAGE_COLUMNS = (
    "stage",
    "layers",
    "weights MiB",
    "RSS MiB",
    "load RSS MiB",
    "micro-batches",
    "compute s",
    "emulated sleep s",
    "MFU %",
    "MBU %",
)

# per stage with streamed weights (`tessel.engine.weight_stream`): its host layers, and per
# micro-batch the transfer time its compute waited for and the time hidden under compute
STREAM_COLUMNS = ("streamed layers", "transfer exposed ms/step", "transfer hidden ms/step")


def measured_stage_utilization(
    stages: list[dict],
    gpu_types: list[str],
    model,
    dtype: str,  # noqa: ANN001 (ModelSpec)
) -> list[dict]:
    """Measured MFU and MBU of each stage: its tokens and batches through its layers
    (`tessel.cost.utilization.stage_token_work`, a lower bound) over its compute seconds, against
    the catalog peak of its device type; {} for a stage whose type the catalog lacks."""
    from tessel.catalog import get_gpu, known_gpus
    from tessel.cost.utilization import stage_token_work, utilization

    out = []
    for s, gpu_type in zip(stages, gpu_types, strict=False):
        if gpu_type not in known_gpus() or "layer_start" not in s:
            out.append({})
            continue
        gpu = get_gpu(gpu_type)
        layers = s["layer_end"] - s["layer_start"]
        work = stage_token_work(model, gpu, layers, dtype, s.get("tokens", 0), s.get("batches", 0))
        out.append(utilization(work, s.get("compute_s", 0.0), gpu).to_json())
    return out


def _percent(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 100:.2f}"


def print_run(run, measured: MeasuredMetrics) -> None:  # noqa: ANN001 (tessel.pipeline.run.PipelineRun)
    console = Console(highlight=False)
    for request in run.requests:
        if len(run.requests) > 1:
            console.print(f"[bold]>>> {request['prompt']}[/bold]", markup=True)
        console.print(request["text"], markup=False)
        console.print(
            f"[dim]({request['num_output_tokens']} tokens, finish_reason={request['finish_reason']})[/dim]"
        )
    table = Table(title=f"pipeline stages ({run.wall_s:.2f} s)")
    streams = any(s.get("stream_layers") for s in run.stages)  # streamed weights: their transfer
    for column in STAGE_COLUMNS + (STREAM_COLUMNS if streams else ()):
        table.add_column(column, justify="right")
    for s in run.stages:
        util = s.get("utilization") or {}
        stream = [
            str(s.get("stream_layers", 0)),
            f"{s.get('stream_exposed_s_per_step', 0.0) * 1e3:.2f}",
            f"{s.get('stream_hidden_s_per_step', 0.0) * 1e3:.2f}",
        ]
        table.add_row(
            str(s.get("stage")),
            f"{s.get('layer_start')}-{s.get('layer_end', 0) - 1}",
            f"{s.get('weight_bytes', 0) / 2**20:.1f}",
            f"{s.get('rss_bytes', 0) / 2**20:.0f}",
            f"{s.get('load_rss_bytes', 0) / 2**20:.0f}",
            str(s.get("batches", "")),
            f"{s.get('compute_s', 0.0):.3f}",
            f"{s.get('emulation_sleep_s', 0.0):.3f}",
            _percent(util.get("mfu")),
            _percent(util.get("mbu")),
            *(stream if streams else []),
        )
    Console(stderr=True).print(table)
    Console(stderr=True).print(measured_table(measured))


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1e3:,.1f}"


def measured_table(measured: MeasuredMetrics) -> Table:
    """The rows `tessel simulate` prints, measured: TTFT and TPOT percentiles in ms, tok/s."""
    table = Table(title="Measured serving metrics")
    table.add_column("metric")
    table.add_column("measured", justify="right")
    for label, summary in (("TTFT", measured.ttft_s), ("TPOT", measured.tpot_s)):
        for stat in ("p50", "p90", "p99", "mean"):
            table.add_row(f"{label} {stat} (ms)", _ms(getattr(summary, stat)))
    table.add_row("throughput (tok/s)", f"{measured.throughput_tok_s:,.1f}")
    table.add_row("wall (s)", f"{measured.wall_s:,.3f}")
    table.add_row("requests", str(measured.requests))
    return table
