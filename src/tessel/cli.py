"""The `tessel` command.

Each subcommand lives in its own module under `tessel.commands` and is registered here. Those
modules import torch only inside the command body, so `tessel plan` works without the runtime
extra. A `TesselError` is printed without a traceback and exits non-zero.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console
from rich.markup import escape

from tessel.commands import catalog_list as _catalog_list
from tessel.commands import chunk as _chunk
from tessel.commands import embed as _embed
from tessel.commands import example_model as _example_model
from tessel.commands import generate as _generate
from tessel.commands import launch as _launch
from tessel.commands import plan as _plan
from tessel.commands import probe as _probe
from tessel.commands import profile as _profile
from tessel.commands import qat as _qat
from tessel.commands import quantize as _quantize
from tessel.commands import serve as _serve
from tessel.commands import simulate as _simulate
from tessel.errors import TesselError

app = typer.Typer(
    name="tessel",
    help="Plan and run LLM inference on clusters of different GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Plan and run LLM inference on clusters of different GPUs."""


@app.command("version")
def version() -> None:
    """Print tessel's version."""
    from tessel import __version__

    typer.echo(__version__)


# Registrations: one entry per subcommand module under tessel.commands, e.g.
#   from tessel.commands import plan as _plan  (at the top)   and   "plan": _plan.plan
COMMANDS = {
    "plan": _plan.plan,
    "probe": _probe.probe,
    "serve": _serve.serve,
    "generate": _generate.generate,
    "simulate": _simulate.simulate,
    "profile": _profile.profile,
    "chunk": _chunk.chunk,
    "launch": _launch.launch,
    "quantize": _quantize.quantize,
    "qat": _qat.qat,
    "example-model": _example_model.example_model,
    "embed": _embed.embed,
    "list": _catalog_list.list_catalog,
}
for _name, _command in COMMANDS.items():
    app.command(_name)(_command)

# What a runtime command imports that a planner-only install (`pip install tessel`) lacks
RUNTIME_MODULES = (
    "torch", "triton", "safetensors", "transformers", "tokenizers", "fastapi", "uvicorn", "prometheus_client",
)  # fmt: skip
RUNTIME_INSTALL = "pip install 'tessel[runtime]'"


def main() -> None:
    """Console entry point: user errors become a message and an exit code, never a traceback."""
    try:
        app()  # standalone: click handles usage errors and --help itself and exits
    except TesselError as error:
        Console(stderr=True).print(f"[bold red]error:[/bold red] {error}", highlight=False)
        sys.exit(error.exit_code)
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if missing not in RUNTIME_MODULES:
            raise
        command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), "this command")
        message = f"`tessel {command}` needs the runtime extra ({missing} is missing): {RUNTIME_INSTALL}"
        Console(stderr=True).print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
