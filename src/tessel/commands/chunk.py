"""`tessel chunk`: cut a long prompt into pipeline chunks (CPP) for a plan, against the baselines."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from tessel.errors import TesselError


def _parse_lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise TesselError(f"--seq-len wants a token count or a comma-separated list, got {text!r}") from None
    if not lengths or min(lengths) <= 0:
        raise TesselError(f"--seq-len must be positive, got {text!r}")
    return lengths


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


def chunk(
    seq_len: str = typer.Option(..., "--seq-len", help="Prompt tokens, or a batch: N1,N2,..."),
    plan: Path | None = typer.Option(None, "--plan", help="Plan JSON from `tessel plan --json`."),
    model: str | None = typer.Option(None, "--model", help="Without --plan: model preset or path."),
    cluster: str = typer.Option(
        "mixed-a100-v100-t4", "--cluster", help="Without --plan: cluster name or YAML."
    ),
    stages: int | None = typer.Option(None, "--stages", help="Without --plan: use the first N devices."),
    dtype: str = typer.Option("fp16", "--dtype", help="Without --plan: weight dtype."),
    grid: int = typer.Option(64, "--grid", help="Chunk boundaries on multiples of this many tokens."),
    max_chunk_tokens: int | None = typer.Option(None, "--max-chunk-tokens", help="Memory cap per chunk."),
    profiles: list[Path] = typer.Option([], "--profile", help="Profile JSON(s) from `tessel profile`."),
    exact: bool | None = typer.Option(
        None, "--exact/--no-exact", help="Force (or skip) the exact search; default: small grids only."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write chunks, TTFT and baselines as JSON."),
) -> None:
    """Plan CPP chunks for a prompt (or a batch) on a plan's pipeline; compare with the baselines."""
    from tessel.chunk.baselines import baseline_plans
    from tessel.chunk.bounds import lower_bound_s
    from tessel.chunk.from_plan import even_split_pipeline, load_plan_pipeline
    from tessel.chunk.planner import ChunkProblem, plan_chunks
    from tessel.cost.profile import load_profile

    lengths = _parse_lengths(seq_len)
    loaded = [load_profile(path) for path in profiles]
    if plan is not None:
        priced = load_plan_pipeline(plan, loaded)
    elif model is not None:
        from tessel.catalog.models import load_model
        from tessel.plan.cluster import load_cluster

        priced = even_split_pipeline(
            load_model(model), load_cluster(cluster), stages, dtype=dtype, profiles=loaded
        )
    else:
        raise TesselError("give --plan PLAN.json, or --model (with --cluster) for an even layer split")
    problem = ChunkProblem(
        priced.pipeline,
        lengths,
        grid,
        max_chunk_tokens,
        tail_s=priced.tail_s,
        flops_linear_tokens=priced.flops_linear_tokens,
    )
    baselines = baseline_plans(problem)
    started = time.perf_counter()
    result = plan_chunks(problem, exact=exact, seeds=[base.chunks for base in baselines.values()])
    planner_s = time.perf_counter() - started
    bound_s = lower_bound_s(problem)

    console = Console()
    stage_text = " -> ".join(f"{s.gpu_type}[{s.unit_start}:{s.unit_end}]" for s in priced.stages)
    console.print(f"{priced.labels.get('model', '?')} on {priced.labels.get('cluster', '?')}: {stage_text}")
    console.print(f"{len(result.chunks)} chunks: {compress_chunks(result.chunks)}")
    status = "optimal on the grid" if result.optimal else "best found (not proven optimal)"
    console.print(
        f"predicted TTFT {result.ttft_s:.4f} s, bubble fraction {result.bubble_fraction:.1%} "
        f"({result.method}, {status}; planned in {planner_s:.2f} s)"
    )
    console.print(
        f"lower bound on any chunking's TTFT: {bound_s:.4f} s (this plan is within "
        f"{result.ttft_s / bound_s - 1:.2%} of it)"
    )
    table = Table(title="CPP vs baselines (same latency model)")
    for column in ("chunking", "chunks", "TTFT (s)", "bubbles", "CPP speedup"):
        table.add_column(column, justify="left" if column == "chunking" else "right")
    table.add_row(
        "cpp", str(len(result.chunks)), f"{result.ttft_s:.4f}", f"{result.bubble_fraction:.1%}", "1.00x"
    )
    for name, base in baselines.items():
        table.add_row(
            name,
            str(len(base.chunks)),
            f"{base.ttft_s:.4f}",
            f"{base.bubble_fraction:.1%}",
            f"{base.ttft_s / result.ttft_s:.2f}x",
        )
    console.print(table)
    if json_out is not None:
        document = {
            "seq_lens": list(lengths),
            "grid_tokens": grid,
            "max_chunk_tokens": max_chunk_tokens,
            "stages": [
                {
                    "device": s.device,
                    "gpu_type": s.gpu_type,
                    "unit_start": s.unit_start,
                    "unit_end": s.unit_end,
                }
                for s in priced.stages
            ],
            "labels": priced.labels,
            "chunks": list(result.chunks),
            "ttft_s": result.ttft_s,
            "request_ttft_s": list(result.schedule.request_ttft_s),
            "bubble_fraction": result.bubble_fraction,
            "method": result.method,
            "optimal": result.optimal,
            "lower_bound_s": bound_s,
            "planner_s": planner_s,
            "baselines": {
                name: {
                    "chunks": list(base.chunks),
                    "ttft_s": base.ttft_s,
                    "bubble_fraction": base.bubble_fraction,
                }
                for name, base in baselines.items()
            },
        }
        json_out.write_text(json.dumps(document, indent=2) + "\n")
        console.print(f"wrote {json_out}")
