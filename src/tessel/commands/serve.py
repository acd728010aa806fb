"""`tessel serve`: an OpenAI-compatible HTTP server for one local model.

torch, fastapi and uvicorn are imported inside the command, so the planner side of the CLI loads
without the runtime extra.
"""

from __future__ import annotations

from pathlib import Path

import typer

from tessel.errors import TesselError

DEFAULT_MAX_QUEUE = 128  # requests that may wait for a free sequence slot before the server answers 429


def serve(
    model: Path = typer.Option(..., "--model", help="Local Hugging Face model directory, or a .gguf file."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (127.0.0.1 keeps it on this machine)."),
    port: int = typer.Option(8000, help="TCP port to listen on."),
    dtype: str = typer.Option("float32", help="Weight and activation dtype: float32, bfloat16, float16."),
    max_num_seqs: int | None = typer.Option(None, help="Most sequences batched in one step."),
    max_model_len: int | None = typer.Option(None, help="Longest prompt + completion, in tokens."),
    kv_cache_gib: float | None = typer.Option(None, help="Memory for the paged KV cache, in GiB."),
    max_queue: int = typer.Option(
        DEFAULT_MAX_QUEUE, help="Requests that may wait beyond the running ones; more get HTTP 429."
    ),
    served_model_name: str | None = typer.Option(
        None, help="Model id for clients (default: the directory name)."
    ),
    log_level: str = typer.Option("info", help="uvicorn log level: critical, error, warning, info, debug."),
) -> None:
    """Serve MODEL over OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, /health."""
    if not model.is_dir() and not (model.suffix.lower() == ".gguf" and model.is_file()):
        raise TesselError(f"--model {model} is not a directory; give a local Hugging Face model directory")
    if max_queue < 0:
        raise TesselError(f"--max-queue must be 0 or more, got {max_queue}")
    if not 0 <= port <= 65535:
        raise TesselError(f"--port must be between 0 and 65535, got {port}")

    import uvicorn

    from tessel.engine.llm_engine import LLMEngine
    from tessel.server.app import create_app

    options = {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len, "kv_cache_gib": kv_cache_gib}
    engine = LLMEngine(str(model), dtype=dtype, **{k: v for k, v in options.items() if v is not None})
    app = create_app(engine, max_pending=engine.config.max_num_seqs + max_queue, model_name=served_model_name)
    typer.echo(f"tessel: serving {app.state.model_name} on http://{host}:{port}/v1", err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
