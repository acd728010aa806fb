"""Where a plan's other stages start: processes on this machine (`executor="local"`), or Ray actors on
the machines the plan names (`executor="ray"`); either way the engine drives a `ProcessExecutor`."""

from __future__ import annotations

from pathlib import Path

from tessel.pipeline.executor import ProcessExecutor
from tessel.pipeline.options import RunOptions


def spawn_pipeline(options: RunOptions, run_dir: Path) -> ProcessExecutor:
    """The plan's other stages started where `options.executor` says: processes on this machine
    ("local"), or Ray actors on the nodes the plan names ("ray", `tessel.pipeline.ray_executor`)."""
    if options.executor == "ray":
        from tessel.pipeline.ray_executor import RayExecutor

        return RayExecutor.spawn(options, run_dir)
    return ProcessExecutor.spawn(options, run_dir)
