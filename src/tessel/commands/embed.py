"""`tessel embed`: sentence embeddings from a local encoder (BERT family, sentence-transformers pooling);
and what `tessel serve` runs when its --model is an encoder (`serve_encoder`: /v1/embeddings).

torch is imported inside the commands, so the planner side of the CLI loads without it. stdout
gets each text's token count, norm and first values (and the cosine similarities of several
texts); `--json OUT` writes every vector.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import typer

from tessel.commands.options import DEVICE_OPTION, output_file, runtime_dtype_option
from tessel.errors import TesselError
from tessel.server.listen import run_server

MATRYOSHKA_OPTION = typer.Option(
    False,
    "--matryoshka",
    help="The encoder was trained for shortened embeddings (Matryoshka): honour `dimensions` "
    "(first d values, renormalised). Without it only the full size is accepted.",
)
SHOWN_VALUES = 4  # values of each vector printed on the console


def is_encoder_dir(model: Path) -> bool:
    """Whether --model is an encoder directory (its config.json names a BERT architecture)."""
    from tessel.models.reader import is_encoder_model  # torch: only when a command runs

    return is_encoder_model(model)


def embed(
    model: Path = typer.Option(..., "--model", help="Local encoder directory (BERT, sentence-transformers)."),
    text: list[str] = typer.Option(..., "--text", help="A text to embed; repeat for several."),
    json_out: Path | None = output_file(None, "--json", help="Write every vector here (JSON)."),
    dtype: str = runtime_dtype_option(),
    batch_size: int = typer.Option(32, min=1, max=4096, help="Texts per forward pass (sorted by length)."),
    threads: int | None = typer.Option(None, min=1, max=1024, help="CPU threads (default: torch's)."),
    truncate: bool = typer.Option(False, help="Cut texts over the model's max_seq_length (default: refuse)."),
    dimensions: int | None = typer.Option(None, min=1, help="Shorter vectors (needs --matryoshka)."),
    matryoshka: bool = MATRYOSHKA_OPTION,
    device: str = DEVICE_OPTION,
) -> None:
    """Embed each --text with the encoder in --model (pooling and normalisation as the model configures)."""
    from tessel.files import check_output_path, write_json_file
    from tessel.text import check_text

    for index, item in enumerate(text):
        check_text(item, f"--text {index + 1}")  # what the embedder's tokenize checks, before it loads
    if json_out is not None:
        check_output_path(json_out, "--json", inputs=(model,))
    from tessel.models.embedder import Embedder

    embedder = Embedder(
        model, dtype=dtype, device=device, batch_size=batch_size, threads=threads, matryoshka=matryoshka
    )
    ids = embedder.tokenize(list(text), truncate)
    vectors = embedder.embed_ids(ids, dimensions)
    for index, (tokens, vector) in enumerate(zip(ids, vectors, strict=True)):
        shown = ", ".join(f"{v:+.4f}" for v in vector[:SHOWN_VALUES].tolist())
        typer.echo(f"[{index}] {len(tokens)} tokens, norm {float(vector.norm()):.4f}: [{shown}, ...]")
    if len(text) > 1:
        typer.echo("cosine similarities:")
        unit = vectors / vectors.norm(dim=1, keepdim=True).clamp(min=1e-12)
        for row in (unit @ unit.T).tolist():
            typer.echo("  " + " ".join(f"{v:+.3f}" for v in row))
    if json_out is not None:
        document = {
            "model": str(embedder.path),
            "dimensions": vectors.shape[1],
            "pooling": list(embedder.pooling.modes),
            "normalized": embedder.pooling.normalize,
            "data": [
                {"index": i, "text": t, "tokens": len(row), "embedding": v.tolist()}
                for i, (t, row, v) in enumerate(zip(text, ids, vectors, strict=True))
            ],
        }
        typer.echo(f"wrote {write_json_file(json_out, document, '--json')}", err=True)


@dataclass(frozen=True, slots=True)
class EncoderServeOptions:
    host: str
    port: int
    dtype: str
    device: str
    served_model_name: str | None
    log_level: str
    matryoshka: bool


def serve_encoder(
    model: Path,
    options: EncoderServeOptions,
    limits: dict,
    plan: Path | None = None,
    listener: socket.socket | None = None,
) -> None:
    """`tessel serve` for an encoder: /v1/embeddings, /v1/models, /health (tessel.server.embeddings)."""
    if plan is not None:
        raise TesselError(f"{model} is an encoder; it is served in one process, without --plan")
    import uvicorn

    from tessel.models.embedder import Embedder
    from tessel.server.embeddings import create_embedding_app
    from tessel.server.limits import ServerLimits

    embedder = Embedder(model, dtype=options.dtype, device=options.device, matryoshka=options.matryoshka)
    app = create_embedding_app(embedder, model_name=options.served_model_name, limits=ServerLimits(**limits))
    where = f"http://{options.host}:{options.port}/v1"
    typer.echo(f"tessel: serving {app.state.model_name} (embeddings) on {where}", err=True)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level)
    run_server(uvicorn.Server(config), listener)
