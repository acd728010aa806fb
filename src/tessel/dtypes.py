"""The one dtype vocabulary of every command: each precision has a short and a long spelling.

`fp32`/`float32`, `bf16`/`bfloat16`, `fp16`/`float16` (also `half`) name the same dtype everywhere.
`int8` and `fp8` are planner precisions (`tessel plan`, `tessel chunk`): the engine computes in
float32, bfloat16 or float16, and a runtime command given one says so. `auto` (the checkpoint's
dtype) is for the commands that load a checkpoint. No torch here: the planner imports this too.
"""

from __future__ import annotations

from tessel.errors import TesselError

# short spelling -> long (torch) spelling, for the precisions the engine computes in
RUNTIME_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
PLAN_ONLY_DTYPES = ("int8", "fp8")
PLAN_DTYPES = (*RUNTIME_DTYPES, *PLAN_ONLY_DTYPES)
ALIASES = {long: short for short, long in RUNTIME_DTYPES.items()} | {"half": "fp16"}
AUTO = "auto"

PLAN_DTYPE_HELP = "fp16, bf16, fp32, int8 or fp8 (float16, bfloat16, float32 also accepted)"
RUNTIME_DTYPE_HELP = "float32, bfloat16, float16 (or fp32, bf16, fp16)"


def parse_dtype(value: str, *, runtime: bool, allow_auto: bool = False) -> str:
    """The canonical name of a dtype as a user spelled it: the short spelling (`bf16`), or `auto`.

    `runtime`: only what the engine computes in (int8 and fp8 refused, naming the planner commands);
    `allow_auto`: `auto` (the checkpoint's dtype) accepted.
    """
    name = str(value).strip().lower().removeprefix("torch.")
    if allow_auto and name == AUTO:
        return AUTO
    short = ALIASES.get(name, name)
    if runtime and short in PLAN_ONLY_DTYPES:
        raise TesselError(
            f"dtype {value!r} is a planner precision (tessel plan, tessel chunk); the engine computes in "
            f"{', '.join(RUNTIME_DTYPES.values())} (int8 weights: tessel quantize, then --dtype float32)"
        )
    allowed = RUNTIME_DTYPES if runtime else PLAN_DTYPES
    if short not in allowed:
        spellings = [*RUNTIME_DTYPES.values(), *allowed] + ([AUTO] if allow_auto else [])
        raise TesselError(f"dtype {value!r} is not supported; use one of {', '.join(spellings)}")
    return short


def runtime_dtype_name(value: str, *, allow_auto: bool = True) -> str:
    """The torch spelling (`bfloat16`) of a runtime dtype in either spelling, or `auto`."""
    short = parse_dtype(value, runtime=True, allow_auto=allow_auto)
    return short if short == AUTO else RUNTIME_DTYPES[short]
