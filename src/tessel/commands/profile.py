"""`tessel profile`: time the engine's decoder layer here and write a profile the cost model reads."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import typer

from tessel.commands.options import float_option, runtime_dtype_option
from tessel.errors import TesselError

CPU_DEFAULT_SCALE = 4  # a full-width 8B layer takes seconds per point on a few CPU cores
DEFAULT_OUT = Path("profile.json")
MAX_TINY_WIDTH = 2**16  # --tiny-shape sizes: above any real layer (Llama-3-405B: h=16384, f=53248)
# Layer copies timed in sequence hold at most this many weight bytes: past any CPU's last-level
# cache (hundreds of MiB on server parts), so the weights stream from memory as in the engine.
MAX_COPY_BYTES = 2 * 2**30


def profile(
    device: Literal["cpu", "cuda"] = typer.Option(
        "cpu", "--device", help="cpu, or cuda (needs a CUDA device)."
    ),
    model: str = typer.Option(
        "llama-3-8b", "--model", help="Model preset or path whose layer shape to time."
    ),
    tiny_shape: str | None = typer.Option(
        None, "--tiny-shape", help="Time this shape instead: h,f,heads,kv_heads (head dim h/heads)."
    ),
    scale: int | None = typer.Option(
        None,
        "--scale",
        min=1,
        max=1024,
        help=f"Divide the model's width by this (default {CPU_DEFAULT_SCALE} on cpu, 1 on cuda).",
    ),
    dtype: str = runtime_dtype_option("float32", help="Layer dtype (float16: cuda only)", auto=False),
    json_path: Path | None = typer.Option(
        None, "--json", dir_okay=False, writable=True, help=f"Write the profile JSON here ({DEFAULT_OUT})."
    ),
    out: Path | None = typer.Option(
        None, "--out", dir_okay=False, writable=True, hidden=True, help="Deprecated spelling of --json."
    ),
    budget_s: float = float_option(
        60.0,
        "--budget-s",
        low=0.01,
        high=86400.0,
        help="Seconds for the whole command after start-up: every timing phase takes its share (a note "
        "says up front when the fewest runs the fits need take longer).",
    ),
    threads: int = typer.Option(1, "--threads", min=0, max=4096, help="CPU threads; 0: PyTorch's default."),
    clock: Literal["auto", "wall", "cpu"] = typer.Option(
        "auto", "--clock", help="auto (CPU time for 1 thread, else wall), wall or cpu."
    ),
    repeats: int = typer.Option(5, "--repeats", min=1, max=1000, help="Timed runs per point (median kept)."),
    warmup: int = typer.Option(1, "--warmup", min=0, max=1000, help="Untimed runs per point."),
    max_chunk: int = typer.Option(
        1024, "--max-chunk", min=16, max=2**20, help="Largest prefill chunk (tokens)."
    ),
    max_offset: int = typer.Option(
        4096, "--max-offset", min=0, max=2**20, help="Largest prefill offset (tokens)."
    ),
    cuda_graphs: bool | None = typer.Option(
        None,
        "--cuda-graphs/--eager",
        help="cuda: time decode as replayed CUDA graphs, as the engine runs it (default), or eagerly "
        "(for an engine run with enforce_eager).",
    ),
    tensor_parallel_size: int = typer.Option(
        1,
        "--tensor-parallel-size",
        min=1,
        max=8,
        help="Time one rank of a tensor-parallel stage of this degree: the busiest rank's layer (its "
        "heads, KV heads, MLP columns: the engine's split) and its vocabulary rows. A model directory.",
    ),
    components: Literal["all", "layer"] = typer.Option(
        "all",
        "--components",
        help="all: also the embedding, LM head + sampling, step overhead (model directory) and "
        "transport; layer: the decoder layer only.",
    ),
) -> None:
    """Time a decoder layer over (chunk, offset) and decode grids, and the embedding, LM head +
    sampling, engine step overhead and stage-to-stage transport; fit each, write JSON."""
    from tessel.deadline import Deadline

    deadline = Deadline.after(budget_s)  # one budget for all that follows: reading the model, every timing
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tessel.commands.render.profile import print_profile
    from tessel.files import check_output_path, write_json_file
    from tessel.profiling.components import transports_for
    from tessel.profiling.layer import ProfileSettings, check_prefill_grid, profile_layer

    out, option = _json_path(json_path, out)
    check_output_path(out, option, inputs=(model,))  # before the timing runs, not after
    if tensor_parallel_size > 1 and scale is None:
        scale = 1  # a rank of the model as the engine splits it, at its own width
    shape, meta, ends, checkpoint = _layer_shape(model, tiny_shape, scale, device)
    if tensor_parallel_size > 1:
        shape, ends = _rank_shape(shape, ends, checkpoint, tensor_parallel_size, meta)
    settings = ProfileSettings(
        layer_copies=_layer_copies(shape, meta, dtype),
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
        cuda_graphs=device == "cuda" and cuda_graphs is not False,
        contention=components == "all" and ends is not None,  # a model's stages may share a CPU host
    )
    check_prefill_grid(settings)  # before the model loads
    if device == "cuda":
        meta["decode_timing"] = "cuda-graph" if settings.cuda_graphs else "eager"

    console = Console()
    console.print(f"profiling {shape.as_dict()} on {device} ({dtype}), budget {budget_s:g} s")
    columns = (TextColumn("timing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("timing", total=None)
        result, report, data = profile_layer(
            shape,
            settings,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
            meta=meta,
            ends=ends if components == "all" else None,
            checkpoint=checkpoint if components == "all" else None,
            transports=transports_for(device) if components == "all" and ends is not None else (),
            note=lambda what: bar.update(task, description=f"timing {what}"),
            deadline=deadline,
            warn=lambda text: console.print(f"note: {text}", highlight=False),
        )
    write_json_file(out, result.to_json(), option, inputs=(model,))
    print_profile(console, result, report, data, out)


def _layer_copies(shape, meta: dict[str, str], dtype: str) -> int:  # noqa: ANN001
    """The model's layer count (a `--tiny-shape` layer: 1), within `MAX_COPY_BYTES` of weights."""
    from tessel.dtypes import parse_dtype

    layers = int(meta.get("layers", "1"))
    itemsize = 4 if parse_dtype(dtype, runtime=True) == "fp32" else 2
    return max(1, min(layers, MAX_COPY_BYTES // max(1, shape.matmul_params * itemsize)))


def _json_path(json_path: Path | None, out: Path | None) -> tuple[Path, str]:
    """--json, or the deprecated --out (a note on stderr); both only when they name one file."""
    if out is None:
        return (json_path or DEFAULT_OUT), "--json"
    if json_path is not None and json_path.expanduser().resolve() != out.expanduser().resolve():
        raise TesselError(f"--json {json_path} and --out {out} name two files; give --json alone")
    typer.echo("note: `tessel profile --out` is now --json (--out still works)", err=True)
    return out, "--out"


def _rank_shape(shape, ends, checkpoint: Path | None, degree: int, meta: dict[str, str]):  # noqa: ANN001, ANN202
    """(LayerShape, EndsShape) of rank 0 of `degree` (`tessel.parallel.split`: it holds the most KV
    heads, so the most attention work, the MLP columns balancing the weights): what a TP stage's
    step waits for. Needs the model's own checkpoint at its own width (no --scale, --tiny-shape)."""
    from tessel.models.config import ModelConfig
    from tessel.parallel.split import TPSplit
    from tessel.profiling.components import EndsShape
    from tessel.profiling.layer import LayerShape

    if checkpoint is None or ends is None:
        raise TesselError(
            "--tensor-parallel-size times one rank of a model directory at its own width: give --model "
            "DIR, without --tiny-shape and with no --scale other than 1"
        )
    split = TPSplit.of(ModelConfig.from_dir(checkpoint), degree, "--tensor-parallel-size")
    rank = split.shards[0]
    meta |= {
        "source": f"{meta['model']} layer, rank 0 of tensor-parallel degree {degree}",
        "tp_degree": str(degree),
        "tp_rank": "0",
    }
    layer = LayerShape(
        shape.hidden_size, rank.intermediate_size, rank.num_heads, rank.num_kv_heads, shape.head_dim
    )
    return layer, EndsShape(ends.hidden_size, rank.vocab_rows, ends.rms_norm_eps)


def _layer_shape(model: str, tiny_shape: str | None, scale: int | None, device: str):  # noqa: ANN202
    """(LayerShape, meta, EndsShape or None, checkpoint directory or None) of `--tiny-shape` (the
    layer alone: no other component), or of the model's layer divided by `--scale` (its embedding
    and LM head at the scaled width)."""
    from tessel.profiling.components import EndsShape
    from tessel.profiling.layer import LayerShape, parse_tiny_shape

    if tiny_shape is not None:
        shape = parse_tiny_shape(tiny_shape)
        if not all(0 < size <= MAX_TINY_WIDTH for size in shape.as_dict().values()):
            raise TesselError(f"--tiny-shape sizes must be from 1 to {MAX_TINY_WIDTH}, got {tiny_shape!r}")
        return shape, {"source": f"--tiny-shape {tiny_shape}"}, None, None
    from tessel.catalog.models import load_model
    from tessel.models.reader import is_checkpoint, read_model

    checkpoint = None
    if is_checkpoint(model):  # a model's files, not a preset or a config.json: checked by the model reader
        model = str(read_model(model).path)
        checkpoint = Path(model)
    spec = load_model(model)
    factor = scale if scale is not None else (CPU_DEFAULT_SCALE if device == "cpu" else 1)
    full = LayerShape(
        spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    )
    meta = {
        "source": f"{spec.name} layer / {factor}",
        "model": spec.name,
        "scale": str(factor),
        "layers": str(spec.num_layers),
    }
    layer = full.scaled(factor)
    ends = EndsShape(layer.hidden_size, spec.vocab_size)
    # the engine's step overhead is timed on the checkpoint itself, so only at its own width
    return layer, meta, ends, checkpoint if factor == 1 else None
