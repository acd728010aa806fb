"""What `tessel launch` prints: the completions, then one row per pipeline stage."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

STAGE_COLUMNS = (
    "stage",
    "layers",
    "weights MiB",
    "RSS MiB",
    "load RSS MiB",
    "micro-batches",
    "compute s",
    "emulated sleep s",
)


def print_run(run) -> None:  # noqa: ANN001 (tessel.pipeline.run.PipelineRun; torch stays out of the CLI import)
    console = Console(highlight=False)
    for request in run.requests:
        if len(run.requests) > 1:
            console.print(f"[bold]>>> {request['prompt']}[/bold]", markup=True)
        console.print(request["text"], markup=False)
        console.print(
            f"[dim]({request['num_output_tokens']} tokens, finish_reason={request['finish_reason']})[/dim]"
        )
    table = Table(title=f"pipeline stages ({run.wall_s:.2f} s)")
    for column in STAGE_COLUMNS:
        table.add_column(column, justify="right")
    for s in run.stages:
        table.add_row(
            str(s.get("stage")),
            f"{s.get('layer_start')}-{s.get('layer_end', 0) - 1}",
            f"{s.get('weight_bytes', 0) / 2**20:.1f}",
            f"{s.get('rss_bytes', 0) / 2**20:.0f}",
            f"{s.get('load_rss_bytes', 0) / 2**20:.0f}",
            str(s.get("batches", "")),
            f"{s.get('compute_s', 0.0):.3f}",
            f"{s.get('emulation_sleep_s', 0.0):.3f}",
        )
    Console(stderr=True).print(table)
