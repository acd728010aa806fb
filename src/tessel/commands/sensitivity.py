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

    from tessel.commands.progress import step_progress
    from tessel.errors import TesselError
    from tessel.files import check_output_path
    from tessel.quant.sensitivity import SensitivityOptions, parse_sensitivity_precisions, write_sensitivity

    check_output_path(out, "--sensitivity", inputs=(model, calib))
    if calib is None:
        raise TesselError("--sensitivity measures on a text: give --calib FILE (UTF-8)")
    options = SensitivityOptions(calib, parse_sensitivity_precisions(precisions), calib_samples, seq_len)
    with step_progress() as progress:
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
