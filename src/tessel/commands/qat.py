"""`tessel qat`: quantisation-aware fine-tuning into a compressed-tensors checkpoint.

torch is imported inside the command, so the planner side of the CLI loads without it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from tessel.commands.options import MODEL_ARGUMENT, MODEL_OPTION, check_model_path, float_option, one_model
from tessel.quant.limits import MAX_QAT_LR, MAX_QAT_STEPS, MIN_QAT_LR


def qat(
    model_argument: Path | None = MODEL_ARGUMENT,
    model_option: Path | None = MODEL_OPTION,
    out: Path = typer.Option(
        ...,
        "--out",
        help="Directory to write the quantised checkpoint to: a new one, or one tessel wrote before with "
        "--overwrite.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an existing --out directory, if tessel wrote it (never another)."
    ),
    train: Path = typer.Option(..., "--train", help="UTF-8 text to fine-tune on."),
    scheme: str = typer.Option("w4a16", help="w8a8, w8a16 or w4a16."),
    steps: int = typer.Option(50, min=1, max=MAX_QAT_STEPS, help="Optimizer steps."),
    lr: float = float_option(
        1e-5,
        "--lr",
        low=MIN_QAT_LR,
        high=MAX_QAT_LR,
        floor_reason="an AdamW step that small moves no weight",
        help="AdamW learning rate (a run whose loss turns inf / nan stops).",
    ),
    seq_len: int = typer.Option(256, min=2, help="Tokens per training window."),
    batch_size: int = typer.Option(1, min=1, help="Windows per step."),
    group_size: int | None = typer.Option(None, min=1, help="Weight columns per scale (w4a16 default 128)."),
    weight_observer: str = typer.Option("mse", help="Weight scales at the start: minmax or mse."),
) -> None:
    """Fine-tune MODEL with fake-quantised linears (clipped STE) and write the quantised checkpoint."""
    from tessel.files import check_output_directory, read_nonempty_text_file

    model = one_model(model_argument, model_option)
    check_model_path(model, "MODEL")
    read_nonempty_text_file(train, "--train")
    check_output_directory(out, "--out", inputs=(model, train), overwrite=overwrite)
    from rich.console import Console

    from tessel.commands.progress import step_progress
    from tessel.quant.qat import QATOptions, train_qat

    options = QATOptions(scheme, train, steps, lr, seq_len, batch_size, group_size, weight_observer)
    with step_progress() as progress:
        progress("qat", 0, steps)
        result = train_qat(model, out, options, progress, overwrite=overwrite)
    Console(highlight=False).print(
        f"{scheme}: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f} over {steps} steps "
        f"in {result.seconds:.1f} s -> {result.out_dir}"
    )
