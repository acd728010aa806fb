"""`tessel list models|clusters|workloads`: what ships with tessel, by the names the other commands take.

Pure Python (the catalog): works in a planner-only install.
"""

from __future__ import annotations

from typing import Literal

import typer

Listing = Literal["models", "clusters", "workloads"]


def list_catalog(
    what: Listing = typer.Argument(..., help="models (--model presets), clusters or workloads."),
    runnable: bool = typer.Option(
        False, "--runnable", help="models: the checkpoint architectures the engine runs, not the presets."
    ),
) -> None:
    """List the bundled model presets, cluster files or workload files."""
    if what == "models" and runnable:
        from tessel.catalog.hf_arch import RUNNABLE_ARCHITECTURES

        for name in RUNNABLE_ARCHITECTURES:
            typer.echo(name)
        return
    if what == "models":
        from tessel.catalog.models import PRESETS

        width = max(len(name) for name in PRESETS)
        for name, (repo, _) in PRESETS.items():
            typer.echo(f"{name:<{width}}  {repo}")
        return
    from tessel.catalog.yaml_reader import bundled_names

    for name in bundled_names(what):
        typer.echo(name)
