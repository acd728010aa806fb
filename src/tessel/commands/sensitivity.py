"""`tessel quantize MODEL --sensitivity OUT.json --calib FILE`: the body behind that option.

torch is imported inside, so the planner side of the CLI loads without it.
"""

from __future__ import annotations

from pathlib import Path


def write_sensitivity_file(
    model: Path, out: Path, calib: Path | None, precisions: str, calib_samples: int, seq_len: int
) -> None:
    """Measure per-layer quality costs on --calib and write them for `tessel plan --sensitivity`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tessel.errors import TesselError
    from tessel.files import check_output_path
    from tessel.quant.sensitivity import SensitivityOptions, parse_sensitivity_precisions, write_sensitivity

    check_output_path(out, "--sensitivity", inputs=(model, calib))
    if calib is None:
        raise TesselError("--sensitivity measures on a text: give --calib FILE (UTF-8)")
    options = SensitivityOptions(calib, parse_sensitivity_precisions(precisions), calib_samples, seq_len)
    console = Console(stderr=True, highlight=False)
    with Progress(
        TextColumn("{task.description:>12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    ) as bar:  # fmt: skip
        task = bar.add_task("sensitivity", total=None)

        def progress(_label: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        result = write_sensitivity(model, out, options, progress)
    largest = {name: max(values) for name, values in result.costs.items()}
    group = f" (int4 groups of {result.int4_group_size})" if result.int4_group_size else ""
    layers = len(next(iter(result.costs.values())))
    Console(highlight=False).print(
        f"{result.model}: {layers} layers x {', '.join(result.costs)}{group}, "
        f"KL to float on {result.calib_tokens} tokens, largest "
        + ", ".join(f"{name} {value:.3g}" for name, value in largest.items())
        + f" nats/token, in {result.seconds:.1f} s -> {result.path}"
    )
