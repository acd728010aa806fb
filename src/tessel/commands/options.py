"""Path and count options the commands share, checked by typer before the command body runs.

A bad value is a usage error: exit code 2 and a message naming the option. Ranges are typer's own
`min=` / `max=` (a float option always gets a `max`, which also refuses nan and inf), choices are
`Literal` types.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

import typer

from tessel.dtypes import PLAN_DTYPE_HELP, RUNTIME_DTYPE_HELP, parse_dtype, runtime_dtype_name
from tessel.errors import TesselError

if TYPE_CHECKING:
    from tessel.models.reader import ModelFiles

# The engine's `lm_head` modes (tessel.models.quantized.lm_head.LM_HEAD_MODES; the CLI may not import torch)
LMHeadMode = Literal["float", "int8"]
LM_HEAD_OPTION = typer.Option(
    "float", "--lm-head", help="float (the checkpoint's) or int8: the LM head rounded per row at load."
)
ENFORCE_EAGER_OPTION = typer.Option(
    False,
    "--enforce-eager",
    help="Run every step eagerly: no compiled CPU decode graphs, no captured CUDA graphs (seconds saved "
    "at the first steps, slower steps after).",
)

# The engine's preemption modes (tessel.engine.preemption.PREEMPTION_MODES; the CLI may not import torch)
PreemptionMode = Literal["auto", "swap", "recompute"]
PREEMPTION_MODE_OPTION = typer.Option(
    "auto",
    "--preemption-mode",
    help="When the KV cache is full, what a preempted request's KV blocks get: swap (copied to host memory "
    "and back), recompute (dropped, prefilled again), or auto (the cheaper for that request: the host "
    "link's bandwidth, measured at start, against the engine's measured prefill time).",
)
HOST_KV_CACHE_GIB_OPTION = typer.Option(
    None,
    "--host-kv-cache-gib",
    max=1024.0,
    help="Host memory for swapped KV blocks, GiB (default: as much as the KV cache, at most 4).",
)
EMULATE_HOST_GBPS_OPTION = typer.Option(
    None,
    "--emulate-host-gbps",
    max=1e6,
    help="Emulation on a CPU-only machine: slow KV copies to and from host memory to this bandwidth, "
    "Gbit/s (a stand-in for a GPU's host link, never a GPU measurement).",
)
FORCE_PROFILE_OPTION = typer.Option(
    False,
    "--force-profile",
    help="Use a --profile measured on another device type, model shape or tessel version anyway "
    "(a warning lists what differs); without it such a profile is refused.",
)

DEVICE_OPTION = typer.Option(
    "cpu",
    "--device",
    help="cpu, cuda or cuda:N: where the model runs (on CUDA tessel's Triton kernels; use --dtype "
    "float16 or bfloat16 there).",
)


def _plan_dtype(value: str) -> str:
    try:
        return parse_dtype(value, runtime=False)
    except TesselError as error:
        raise typer.BadParameter(str(error)) from None


def _runtime_dtype(value: str) -> str:
    try:
        return runtime_dtype_name(value)
    except TesselError as error:
        raise typer.BadParameter(str(error)) from None


def _runtime_dtype_no_auto(value: str) -> str:  # typer callbacks take the value alone
    try:
        return runtime_dtype_name(value, allow_auto=False)
    except TesselError as error:
        raise typer.BadParameter(str(error)) from None


def plan_dtype_option(default: str, *names: str, help: str):  # noqa: A002, ANN201 (typer's OptionInfo)
    """A planner precision in either spelling (tessel.dtypes), passed on as the short one (`bf16`)."""
    return typer.Option(
        default, *names, callback=_plan_dtype, metavar="DTYPE", help=f"{help}: {PLAN_DTYPE_HELP}."
    )


def runtime_dtype_option(  # noqa: ANN201 (typer's OptionInfo)
    default: str = "float32",
    help: str = "Weight and activation dtype",
    auto: bool = True,  # noqa: A002
):
    """A dtype the engine computes in, either spelling (or auto), passed on as the torch one (`bfloat16`)."""
    return typer.Option(
        default,
        "--dtype",
        callback=_runtime_dtype if auto else _runtime_dtype_no_auto,
        metavar="DTYPE",
        help=f"{help}: {RUNTIME_DTYPE_HELP}" + (", or auto (the checkpoint's)." if auto else "."),
    )


def input_file(default: Path | None, *names: str, help: str):  # noqa: A002, ANN201 (typer's OptionInfo)
    """An existing, readable file (not a directory); its content is checked by the reader."""
    return typer.Option(default, *names, help=help, exists=True, dir_okay=False, readable=True)


def output_file(default: Path | None, *names: str, help: str):  # noqa: A002, ANN201
    """A file to write: refused when it is a directory, before the command runs."""
    return typer.Option(default, *names, help=help, dir_okay=False, writable=True)


MODEL_ARGUMENT = typer.Argument(
    None, metavar="MODEL", show_default=False, help="Local Hugging Face model directory or .gguf file."
)
MODEL_OPTION = typer.Option(None, "--model", help="The same as MODEL (as in generate and serve).")


def one_model(positional: Path | None, option: Path | None) -> Path:
    """MODEL given as the positional argument or as --model (one of them; both only when the same)."""
    if positional is None and option is None:
        raise TesselError("give the model: MODEL (the first argument) or --model MODEL")
    if positional is not None and option is not None and Path(positional).resolve() != Path(option).resolve():
        raise TesselError(
            f"two models given: MODEL {str(positional)!r} and --model {str(option)!r}; give one"
        )
    return positional if positional is not None else option


def check_model_path(path: Path, option: str) -> ModelFiles:
    """A model is a local Hugging Face directory or a .gguf file (generate, serve, quantize, qat): checked
    by the one model reader (config, weights' headers and shapes) before the command does heavy work."""
    from tessel.models.reader import read_model  # torch: only when a command runs

    return read_model(path, option)


def optional_count(*names: str, limit: int, help: str | None = None, hidden: bool = False):  # noqa: A002, ANN201
    """A whole number in [1, limit], or None (the command's default)."""
    return typer.Option(None, *names, min=1, max=limit, help=help, hidden=hidden)


def host_kv_options(
    preemption_mode: str, host_kv_cache_gib: float | None, emulate_host_gbps: float | None
) -> dict[str, object]:
    """The engine's preemption settings from the options, sizes and bandwidths > 0 (typer's `max`
    has refused nan and inf); the ones left out are not in the dict."""
    if host_kv_cache_gib is not None and host_kv_cache_gib <= 0:
        raise TesselError(f"--host-kv-cache-gib must be > 0, got {host_kv_cache_gib:g}")
    if emulate_host_gbps is not None and emulate_host_gbps <= 0:
        raise TesselError(f"--emulate-host-gbps must be a bandwidth > 0 (Gbit/s), got {emulate_host_gbps:g}")
    options = {"host_kv_cache_gib": host_kv_cache_gib, "emulate_host_gbps": emulate_host_gbps}
    return {"preemption_mode": preemption_mode} | {k: v for k, v in options.items() if v is not None}
