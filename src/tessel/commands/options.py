"""Path, count and number options the commands share, checked by typer before the command body runs.

A bad value is a usage error: exit code 2 and a message naming the option. Every float option is a
`float_option`: both bounds in --help, NaN and inf refused as such, a value below the floor refused
naming it (and why it is there). Int ranges are typer's own `min=` / `max=`; choices are `Literal`
types. Options that several commands take together are an `OptionGroup` (the host KV cache here, the
remap decision in `remap_options`): a command declares the group as one parameter and gets one value.
"""

from __future__ import annotations

import functools
import inspect
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import typer

from tessel.dtypes import PLAN_DTYPE_HELP, RUNTIME_DTYPE_HELP, parse_dtype, runtime_dtype_name
from tessel.engine.limits import MAX_KV_CACHE_GIB, MIN_KV_CACHE_GIB
from tessel.errors import TesselError
from tessel.pipeline.supervision.heartbeat import MAX_HEARTBEAT_TIMEOUT_S, MIN_HEARTBEAT_TIMEOUT_S
from tessel.plan.files.cluster import MAX_LINK_GBPS
from tessel.plan.files.plan_parts import MIN_EMULATE_HOST_GBPS

if TYPE_CHECKING:
    from tessel.models.reader import ModelFiles


def float_option(  # noqa: ANN201 (typer's OptionInfo)
    default: float | None,
    *names: str,
    low: float,
    high: float,
    help: str,  # noqa: A002
    floor_reason: str = "",
    hidden: bool = False,
):
    """A number in [low, high], checked as typer parses it, before the command body: NaN is refused as
    NaN, inf as not finite, a value below `low` naming that floor and `floor_reason` (why it is there).
    --help shows both bounds ([low<=x<=high]); typer's `min=`/`max=` only show them, the parser checks."""
    return typer.Option(
        default,
        *names,
        min=low,
        max=high,
        parser=_float_in(low, high, floor_reason),
        help=help,
        hidden=hidden,
    )


def optional_float(  # noqa: ANN201 (typer's OptionInfo)
    *names: str,
    low: float,
    high: float,
    help: str,
    floor_reason: str = "",  # noqa: A002
):
    """A number in [low, high] (a `float_option`), or None: the command's default."""
    return float_option(None, *names, low=low, high=high, help=help, floor_reason=floor_reason)


def _float_in(low: float, high: float, floor_reason: str) -> Callable[[str | float], float]:
    span = f"[{low:g}, {high:g}]"

    def parse(value: str | float) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise typer.BadParameter(f"{str(value)[:40]!r} is not a number; give one in {span}") from None
        if math.isnan(number):
            raise typer.BadParameter(f"NaN is not a number; give one in {span}")
        if math.isinf(number):
            raise typer.BadParameter(f"{number} is not finite; give a number in {span}")
        if number < low:
            why = f" ({floor_reason})" if floor_reason else ""
            raise typer.BadParameter(f"{number:g} is below {low:g}{why}; give a number in {span}")
        if number > high:
            raise typer.BadParameter(f"{number:g} is above {high:g}; give a number in {span}")
        return number

    return parse


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
ASYNC_SCHEDULING_OPTION = typer.Option(
    False,
    "--async-scheduling",
    help="Overlap the host's work with the decode steps: the next step prepared while one computes and "
    "launched before its tokens are applied (one process), or, with --plan, stage 0 computing while the "
    "next micro-batch is scheduled; pays where the device computes without the host, a GPU; docs/engine.md.",
)
TENSOR_PARALLEL_OPTION = typer.Option(
    1,
    "--tensor-parallel-size",
    min=1,
    help="Split the model over this many ranks: this process and N-1 it starts on this machine (CPU: "
    "shared-memory all-reduce; CUDA: GPUs 0..N-1, NCCL). The degree may not exceed the KV heads.",
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
KV_FLOOR = "less holds no KV block"
HEARTBEAT_FLOOR = "several heartbeats must fit in it"
HOST_KV_CACHE_GIB_OPTION = optional_float(
    "--host-kv-cache-gib", low=MIN_KV_CACHE_GIB, high=MAX_KV_CACHE_GIB, floor_reason=KV_FLOOR,
    help="Host memory for swapped KV blocks, GiB (default: as much as the KV cache, at most 4).",
)  # fmt: skip
EMULATE_HOST_GBPS_OPTION = optional_float(
    "--emulate-host-gbps", low=MIN_EMULATE_HOST_GBPS, high=MAX_LINK_GBPS,
    floor_reason="slower, each KV copy waits for hours",
    help="Emulation on a CPU-only machine: slow KV copies to and from host memory to this bandwidth, "
    "Gbit/s (a stand-in for a GPU's host link, never a GPU measurement).",
)  # fmt: skip
# Sampling, as `tessel generate` and `tessel launch` take it (tessel.engine.sampling_params checks the
# rest: top_p 0 is refused there, with the HTTP API's message)
MAX_TEMPERATURE = 100.0  # logits / 100 are near-uniform: a higher temperature samples no differently
TEMPERATURE_OPTION = float_option(
    0.0, "--temperature", low=0.0, high=MAX_TEMPERATURE, help="0 is greedy; higher samples more freely."
)
TOP_P_OPTION = float_option(1.0, "--top-p", low=0.0, high=1.0, help="Nucleus sampling mass (1 = off).")
TOP_K_OPTION = typer.Option(0, "--top-k", min=-1, help="Sample among the k most likely tokens (0 = off).")
MAX_TOKENS_OPTION = typer.Option(64, "--max-tokens", min=1, help="Most tokens to generate per prompt.")
SEED_OPTION = typer.Option(None, "--seed", help="Seed for reproducible sampling.")
IGNORE_EOS_OPTION = typer.Option(
    False, "--ignore-eos/--no-ignore-eos", help="Keep generating past the end-of-sequence token."
)
# The engine's sizes, as `tessel generate`, `serve` and `launch` take them
MAX_NUM_SEQS_OPTION = typer.Option(None, "--max-num-seqs", min=1, help="Most sequences batched in one step.")
MAX_MODEL_LEN_OPTION = typer.Option(
    None, "--max-model-len", min=2, help="Longest prompt + completion, in tokens."
)


def kv_cache_gib_option(help: str):  # noqa: A002, ANN201 (typer's OptionInfo)
    """--kv-cache-gib: the paged KV cache's size in GiB, or None (the engine sizes it)."""
    return optional_float(
        "--kv-cache-gib", low=MIN_KV_CACHE_GIB, high=MAX_KV_CACHE_GIB, floor_reason=KV_FLOOR, help=help
    )


def heartbeat_timeout_option(help: str):  # noqa: A002, ANN201 (typer's OptionInfo)
    """--heartbeat-timeout: seconds a pipeline stage may stay silent, or None ($TESSEL_HEARTBEAT_TIMEOUT_S
    or 30); `help` says what happens past it."""
    return optional_float(
        "--heartbeat-timeout", low=MIN_HEARTBEAT_TIMEOUT_S, high=MAX_HEARTBEAT_TIMEOUT_S,
        floor_reason=HEARTBEAT_FLOOR, help=f"{help} (default: $TESSEL_HEARTBEAT_TIMEOUT_S or 30).",
    )  # fmt: skip


FORCE_PROFILE_OPTION = typer.Option(
    False,
    "--force-profile",
    help="Use a --profile measured on another device type, model shape or tessel version anyway "
    "(a warning lists what differs); without it such a profile is refused.",
)

# Where a plan's other stages run (tessel.pipeline.spawn.spawn_pipeline; the CLI may not import torch)
ExecutorKind = Literal["local", "ray"]
EXECUTOR_OPTION = typer.Option(
    "local",
    "--executor",
    help="Where the plan's stages run: local (one process per stage on this machine) or ray (each on "
    "the machine its plan device names: `ray start ... --labels tessel.node=NAME` on every machine; "
    'stage 0 runs here). Ray is the cluster extra: pip install "tessel[cluster]".',
)
RAY_ADDRESS_OPTION = typer.Option(
    None,
    "--ray-address",
    help="With --executor ray: HOST:PORT of the Ray cluster's head (default: the cluster this machine "
    "joined with `ray start`).",
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


@dataclass(frozen=True, slots=True)
class OptionGroup:
    """Options several commands take together, declared once: parameter name -> (its type, its typer
    option). A command declares the group as one parameter whose default is the group and is decorated
    `with_option_groups`; it then gets `collect(**the options' values)` in that parameter."""

    options: dict[str, tuple[Any, Any]]
    collect: Callable[..., Any]


def with_option_groups(command: Callable[..., None]) -> Callable[..., None]:
    """`command` as typer reads it: each parameter whose default is an `OptionGroup` spelled out in its
    place as the group's options (same --help order); called, it collects them back into that parameter."""
    signature = inspect.signature(command)
    hints = typing.get_type_hints(command)
    params = signature.parameters
    groups = {name: p.default for name, p in params.items() if isinstance(p.default, OptionGroup)}
    spelled = []
    for name, param in params.items():
        options = groups[name].options.items() if name in groups else [(name, (hints[name], param.default))]
        spelled += [inspect.Parameter(n, param.kind, default=o, annotation=t) for n, (t, o) in options]

    @functools.wraps(command)
    def run(**values: Any) -> None:
        for name, group in groups.items():
            values[name] = group.collect(**{option: values.pop(option) for option in group.options})
        command(**values)

    run.__signature__ = signature.replace(parameters=spelled)
    run.__annotations__ = {p.name: p.annotation for p in spelled} | {"return": None}
    return run


def host_kv_options(
    preemption_mode: str, host_kv_cache_gib: float | None, emulate_host_gbps: float | None
) -> dict[str, object]:
    """The engine's preemption settings from the options (their ranges checked as they were parsed);
    the ones left out are not in the dict."""
    options = {"host_kv_cache_gib": host_kv_cache_gib, "emulate_host_gbps": emulate_host_gbps}
    return {"preemption_mode": preemption_mode} | {k: v for k, v in options.items() if v is not None}


# --preemption-mode, --host-kv-cache-gib, --emulate-host-gbps -> the engine's preemption settings
HOST_KV_OPTIONS = OptionGroup(
    {
        "preemption_mode": (PreemptionMode, PREEMPTION_MODE_OPTION),
        "host_kv_cache_gib": (float | None, HOST_KV_CACHE_GIB_OPTION),
        "emulate_host_gbps": (float | None, EMULATE_HOST_GBPS_OPTION),
    },
    host_kv_options,
)
