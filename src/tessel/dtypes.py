"""The one dtype vocabulary of every command: each precision has a short and a long spelling.

`fp32`/`float32`, `bf16`/`bfloat16`, `fp16`/`float16` (also `half`) name the same dtype everywhere.
The planner (`tessel plan`, `tessel chunk`) also takes `int8` weights, and an `fp8` KV cache: a weight
precision is priced at its peak FLOP/s, so only those the GPU catalog has a peak for are offered
(`PLAN_DTYPES`: `tessel.catalog.gpus` prices exactly these), while a KV cache is priced by its bytes
alone (`KV_DTYPES`). The engine computes in float32, bfloat16 or float16, and a runtime command given
a planner precision says so. `auto` (the checkpoint's dtype) is for the commands that load a
checkpoint. Each option's help and each refusal are written from these lists. No torch here: the
planner imports this too.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessel.errors import TesselError

# short spelling -> long (torch) spelling, for the precisions the engine computes in
RUNTIME_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# weight precisions the planner prices: gpus.yaml gives every GPU a peak FLOP/s for each (no fp8: T4,
# V100 and A100 have no fp8 tensor cores, so the catalog has no fp8 peak to price a GEMM at)
PLAN_DTYPES = (*RUNTIME_DTYPES, "int8")
# KV cache precisions the planner prices: by their bytes alone (fp8: vLLM's --kv-cache-dtype fp8)
KV_DTYPES = (*PLAN_DTYPES, "fp8")
PLAN_ONLY_DTYPES = tuple(name for name in KV_DTYPES if name not in RUNTIME_DTYPES)
ALIASES = {long: short for short, long in RUNTIME_DTYPES.items()} | {"half": "fp16"}
AUTO = "auto"


def dtype_help(names: Sequence[str]) -> str:
    """An option's list of the dtypes it takes: "fp32, bf16, fp16 or int8 (float32, ... also accepted)"."""
    longs = [RUNTIME_DTYPES[name] for name in names if name in RUNTIME_DTYPES]
    listed = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
    return f"{listed} ({', '.join(longs)} also accepted)"


PLAN_DTYPE_HELP = dtype_help(PLAN_DTYPES)
KV_DTYPE_HELP = dtype_help(KV_DTYPES)
RUNTIME_DTYPE_HELP = f"{', '.join(RUNTIME_DTYPES.values())} (or {', '.join(RUNTIME_DTYPES)})"


def parse_dtype(value: str, *, runtime: bool, allow_auto: bool = False, kv: bool = False) -> str:
    """The canonical name of a dtype as a user spelled it: the short spelling (`bf16`), or `auto`.

    `runtime`: only what the engine computes in (int8 and fp8 refused, naming the planner commands);
    else a planner precision: of the weights (`PLAN_DTYPES`), or with `kv` of the KV cache
    (`KV_DTYPES`). `allow_auto`: `auto` (the checkpoint's dtype) accepted.
    """
    name = str(value).strip().lower().removeprefix("torch.")
    if allow_auto and name == AUTO:
        return AUTO
    short = ALIASES.get(name, name)
    if runtime and short in PLAN_ONLY_DTYPES:
        where = "tessel plan, tessel chunk" if short in PLAN_DTYPES else "tessel plan --kv-dtype"
        raise TesselError(
            f"dtype {value!r} is a planner precision ({where}); the engine computes in "
            f"{', '.join(RUNTIME_DTYPES.values())} (int8 weights: tessel quantize, then --dtype float32)"
        )
    allowed = RUNTIME_DTYPES if runtime else KV_DTYPES if kv else PLAN_DTYPES
    if short not in allowed:
        spellings = [*RUNTIME_DTYPES.values(), *allowed] + ([AUTO] if allow_auto else [])
        why = ""
        if short in KV_DTYPES:  # fp8 weights: a KV cache dtype only
            why = f" for weights (the GPU catalog has no {short} peak FLOP/s to price them at)"
        raise TesselError(f"dtype {value!r} is not supported{why}; use one of {', '.join(spellings)}")
    return short


def runtime_dtype_name(value: str, *, allow_auto: bool = True) -> str:
    """The torch spelling (`bfloat16`) of a runtime dtype in either spelling, or `auto`."""
    short = parse_dtype(value, runtime=True, allow_auto=allow_auto)
    return short if short == AUTO else RUNTIME_DTYPES[short]
