"""What `tessel chunk` prints: the stages, the chunks, the predicted TTFT against the baselines."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from tessel.chunk.api import ChunkOutcome


def compress_chunks(chunks: tuple[int, ...] | list[int], limit: int = 24) -> str:
    """'512 x3, 448, 384 x2' (runs of equal sizes), cut after `limit` runs."""
    runs: list[list[int]] = []
    for size in chunks:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    text = [f"{size} x{count}" if count > 1 else str(size) for size, count in runs[:limit]]
    if len(runs) > limit:
        text.append(f"... ({len(runs) - limit} more runs)")
    return ", ".join(text)


def print_chunks(console: Console, outcome: ChunkOutcome) -> None:
    priced, result, bound_s = outcome.priced, outcome.plan, outcome.lower_bound_s
    stage_text = " -> ".join(f"{s.gpu_type}[{s.unit_start}:{s.unit_end}]" for s in priced.stages)
    console.print(f"{priced.labels.get('model', '?')} on {priced.labels.get('cluster', '?')}: {stage_text}")
    console.print(f"{len(result.chunks)} chunks: {compress_chunks(result.chunks)}")
    status = "optimal on the grid" if result.optimal else "best found (not proven optimal)"
    console.print(
        f"predicted TTFT {result.ttft_s:.4f} s, bubble fraction {result.bubble_fraction:.1%} "
        f"({result.method}, {status}; planned in {outcome.planner_s:.2f} s)"
    )
    console.print(
        f"lower bound on any chunking's TTFT: {bound_s:.4f} s (this plan is within "
        f"{result.ttft_s / bound_s - 1:.2%} of it)"
    )
    console.print(_baseline_table(outcome))


def _baseline_table(outcome: ChunkOutcome) -> Table:
    result = outcome.plan
    table = Table(title="CPP vs baselines (same latency model)")
    for column in ("chunking", "chunks", "TTFT (s)", "bubbles", "CPP speedup"):
        table.add_column(column, justify="left" if column == "chunking" else "right")
    table.add_row(
        "cpp", str(len(result.chunks)), f"{result.ttft_s:.4f}", f"{result.bubble_fraction:.1%}", "1.00x"
    )
    for name, base in outcome.baselines.items():
        table.add_row(
            name,
            str(len(base.chunks)),
            f"{base.ttft_s:.4f}",
            f"{base.bubble_fraction:.1%}",
            f"{base.ttft_s / result.ttft_s:.2f}x",
        )
    return table
