"""`tessel quantize`: post-training quantisation into a compressed-tensors checkpoint.

torch is imported inside the command, so the planner side of the CLI loads without it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from tessel.commands.options import MODEL_ARGUMENT, MODEL_OPTION, check_model_path, one_model


def quantize(
    model_argument: Path | None = MODEL_ARGUMENT,
    model_option: Path | None = MODEL_OPTION,
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Directory to write the quantised checkpoint to (required unless --sensitivity); a new one, "
        "or one tessel wrote before with --overwrite.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an existing --out directory, if tessel wrote it (never another)."
    ),
    scheme: str = typer.Option("w8a8", help="w8a8, w8a16 or w4a16."),
    act: str = typer.Option("dynamic", help="w8a8 activations: dynamic (per token) or static (per tensor)."),
    observer: str = typer.Option(
        "minmax", help="Static activations: minmax, moving-average, percentile, entropy or mse."
    ),
    weight_observer: str = typer.Option("minmax", help="Weights: minmax or mse (clip search)."),
    smoothquant: str | None = typer.Option(
        None, help="SmoothQuant alpha in [0, 1] (e.g. 0.5, 0.8), or auto (the best of 0.3-0.9 per group)."
    ),
    calib: Path | None = typer.Option(
        None, help="UTF-8 text to calibrate on (SmoothQuant, static activations, GPTQ)."
    ),
    calib_samples: int = typer.Option(32, min=1, help="Calibration windows."),
    seq_len: int = typer.Option(512, min=2, help="Tokens per calibration window."),
    group_size: int | None = typer.Option(
        None, min=1, help="Weight columns per scale (w4a16 default 128); none: per output channel."
    ),
    sensitivity: Path | None = typer.Option(
        None, "--sensitivity", help="Instead of --out: per-layer quality costs on --calib, for `tessel plan`."
    ),
    precisions: str = typer.Option("int8,int4", help="--sensitivity: the precisions to measure."),
    method: str = typer.Option("rtn", help="Weights: rtn (round to nearest) or gptq (needs --calib)."),
    act_order: bool = typer.Option(False, help="GPTQ: round columns by descending Hessian diagonal."),
    static_groups: bool = typer.Option(
        False, help="GPTQ: group scales from the original weights up front (llm-compressor's rule)."
    ),
    awq: bool = typer.Option(False, help="AWQ activation-aware channel scaling first (needs --calib)."),
    asym: bool = typer.Option(
        False, help="w8a16 / w4a16: asymmetric weights, a zero point per scale (llm-compressor's W4A16_ASYM)."
    ),
    float_layers: str = typer.Option(
        "",
        help="Decoder layers whose linears stay float, e.g. 0,17 (named in the checkpoint's ignore list): "
        "the layers `--sensitivity` finds costliest.",
    ),
    weight_code_bits: int = typer.Option(
        8,
        help="w8a8: 7 keeps the int8 weight codes in [-63, 63] (still an int8 checkpoint), so AVX2 CPUs "
        "without VNNI run fbgemm's int8 GEMM with 8-bit activations (docs/quant.md).",
    ),
) -> None:
    """Quantise MODEL and write a compressed-tensors checkpoint (vLLM / llm-compressor layout) to --out."""
    from tessel.errors import TesselError
    from tessel.files import check_output_directory, read_nonempty_text_file

    model = one_model(model_argument, model_option)
    check_model_path(model, "MODEL")
    if (out is None) == (sensitivity is None):
        raise TesselError("give one of --out DIR (a quantised checkpoint) or --sensitivity FILE (costs)")
    if calib is not None:  # checked even when the scheme does not calibrate
        read_nonempty_text_file(calib, "--calib")
    if out is not None:  # before the work (and again when it is written)
        check_output_directory(out, "--out", inputs=(model, calib), overwrite=overwrite)
    if sensitivity is not None:
        from tessel.commands.sensitivity import write_sensitivity_file

        return write_sensitivity_file(model, sensitivity, calib, precisions, calib_samples, seq_len)
    from rich.console import Console

    from tessel.commands.progress import step_progress
    from tessel.quant.calibrate import QuantizeOptions, parse_layer_list, quantize_model

    options = QuantizeOptions(
        scheme,
        act,
        observer,
        weight_observer,
        smoothquant,
        calib,
        calib_samples,
        seq_len,
        group_size,
        method=method,
        act_order=act_order,
        static_groups=static_groups,
        awq=awq,
        asym=asym,
        weight_code_bits=weight_code_bits,
        float_layers=parse_layer_list(float_layers, "--float-layers"),
    )
    with step_progress() as progress:
        result = quantize_model(model, out, options, progress, overwrite=overwrite)
    Console(highlight=False).print(
        f"{result.scheme}: {result.num_linears} linears quantised"
        + (
            f", {result.smoothed_groups} {'AWQ' if awq else 'SmoothQuant'} groups"
            if result.smoothed_groups
            else ""
        )
        + (f", calibrated on {result.calib_tokens} tokens" if result.calib_tokens else "")
        + f" in {result.seconds:.1f} s -> {result.out_dir}"
    )
