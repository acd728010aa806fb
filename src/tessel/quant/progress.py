"""The progress of the toolkit's long passes: `progress(label, done, total)` after each step of a pass
(a calibration window, a layer, a training step). `tessel quantize`, `tessel qat` and the sensitivity
command draw it on stderr (`tessel.commands.progress.step_progress`); the Python API may pass None."""

from __future__ import annotations

from collections.abc import Callable

StepProgress = Callable[[str, int, int], None]  # (pass name, steps done, steps in the pass)


def report(progress: StepProgress | None, label: str, done: int, total: int) -> None:
    """Tell `progress` (where there is one) that `done` of the `total` steps of pass `label` are done."""
    if progress is not None:
        progress(label, done, total)
