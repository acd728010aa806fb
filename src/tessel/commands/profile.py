"""`tessel profile`: time the engine's decoder layer here and write a profile the cost model reads."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tessel.errors import TesselError

CPU_DEFAULT_SCALE = 4  # a full-width 8B layer takes seconds per point on a few CPU cores


def profile(
    device: str = typer.Option("cpu", "--device", help="cpu, or cuda (needs a CUDA device)."),
    model: str = typer.Option(
        "llama-3-8b", "--model", help="Model preset or path whose layer shape to time."
    ),
    tiny_shape: str | None = typer.Option(
        None, "--tiny-shape", help="Time this shape instead: h,f,heads,kv_heads (head dim h/heads)."
    ),
    scale: int | None = typer.Option(
        None,
        "--scale",
        help=f"Divide the model's width by this (default {CPU_DEFAULT_SCALE} on cpu, 1 on cuda).",
    ),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16 (cuda)."),
    out: Path = typer.Option(Path("profile.json"), "--out", help="Where to write the profile JSON."),
    budget_s: float = typer.Option(60.0, "--budget-s", help="Time budget for the timing runs (seconds)."),
    threads: int = typer.Option(1, "--threads", help="CPU threads; 0: PyTorch's default."),
    clock: str = typer.Option(
        "auto", "--clock", help="auto (CPU time for 1 thread, else wall), wall or cpu."
    ),
    repeats: int = typer.Option(5, "--repeats", help="Timed runs per point (the median is kept)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed runs per point."),
    max_chunk: int = typer.Option(1024, "--max-chunk", help="Largest prefill chunk timed (tokens)."),
    max_offset: int = typer.Option(4096, "--max-offset", help="Largest prefill offset timed (tokens)."),
) -> None:
    """Time a decoder layer over (chunk, offset) and decode grids, fit the profile forms, write JSON."""
    from tessel.models.profiler import LayerShape, ProfileSettings, parse_tiny_shape, profile_layer

    if budget_s <= 0 or repeats < 1 or warmup < 0 or threads < 0:
        raise TesselError("--budget-s must be > 0, --repeats >= 1, --warmup >= 0 and --threads >= 0")
    if max_chunk < 16 or max_offset < 0:
        raise TesselError("--max-chunk must be >= 16 and --max-offset >= 0")
    meta: dict[str, str] = {}
    if tiny_shape is not None:
        shape = parse_tiny_shape(tiny_shape)
        meta["source"] = f"--tiny-shape {tiny_shape}"
    else:
        from tessel.catalog.models import load_model

        spec = load_model(model)
        factor = scale if scale is not None else (CPU_DEFAULT_SCALE if device == "cpu" else 1)
        if factor < 1:
            raise TesselError(f"--scale must be >= 1, got {factor}")
        full = LayerShape(
            spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        )
        shape = full.scaled(factor)
        meta |= {"source": f"{spec.name} layer / {factor}", "model": spec.name, "scale": str(factor)}
    settings = ProfileSettings(
        device=device,
        dtype=dtype,
        budget_s=budget_s,
        threads=threads or None,
        clock=clock,
        warmup=warmup,
        repeats=repeats,
        max_chunk_tokens=max_chunk,
        max_offset_tokens=max_offset,
        max_decode_context=max(max_offset, 128),
    )
    console = Console()
    console.print(f"profiling {shape.as_dict()} on {device} ({dtype}), budget {budget_s:g} s")
    columns = (TextColumn("timing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("timing", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        result, report, data = profile_layer(shape, settings, progress=progress, meta=meta)
    result.save(out)
    table = Table(title=f"profile of one decoder layer on {result.device_type}")
    table.add_column("fit")
    table.add_column("coefficients")
    table.add_column("points", justify="right")
    table.add_column("held-out error", justify="right")
    pre, dec = result.prefill, result.decode
    table.add_row(
        "prefill t(c,p)",
        f"a0={pre.a0:.3e} a1={pre.a1:.3e} a2={pre.a2:.3e} a3={pre.a3:.3e}",
        str(len(data.prefill_times_s)),
        f"{report.prefill_heldout_error:.1%}",
    )
    table.add_row(
        "decode t(B,S)",
        f"b0={dec.b0:.3e} b1={dec.b1:.3e} b2={dec.b2:.3e}",
        str(len(data.decode_times_s)),
        f"{report.decode_heldout_error:.1%}",
    )
    console.print(table)
    efficiencies = []
    if result.compute_efficiency is not None:
        efficiencies.append(f"compute {result.compute_efficiency:.1%} of catalog peak")
    if result.memory_efficiency is not None:
        efficiencies.append(f"memory {result.memory_efficiency:.1%} of catalog bandwidth")
    if efficiencies:
        console.print("implied efficiency: " + ", ".join(efficiencies))
    console.print(f"held-out mean relative error {result.heldout_rel_error:.1%}; wrote {out}")
