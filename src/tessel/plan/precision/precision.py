"""Which weight precisions a plan may use per layer, and the quality budget that bounds them.

`--precisions fp16,int8,int4` lists the precisions a unit may take; the one with the most bytes
is the reference (quality cost 0). What each precision means for bytes and compute is
`tessel.cost.layer.WEIGHT_SCHEMES` (int8 = W8A8 at the int8 rate, int4 = W4A16 at the fp16 rate).
The KV cache keeps the plan's one `--kv-dtype`.

The quality cost of a plan is the sum of its units' costs (`tessel.plan.precision.quality`). The user bounds
it with `--quality-budget B` (total cost at most B) or `--theta` (LLM-PQ's trade-off: the objective
gains theta seconds per unit of cost). With neither, `default_budget`: the cost of W8A8 on half of
the layers. On a model whose layers all have the same shape (every preset) the default indicator
gives every layer the same cost, so this allows int8 on at most half of the layers; an int4 layer
(groups of 128) costs as much as 160-174 int8 layers on the presets (159.6 on Llama-3-70B), more
than the whole budget of any of them, so it allows no int4 at all.
"""

from __future__ import annotations

import numpy as np

from tessel.cost import layer as L
from tessel.errors import TesselError

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")
DEFAULT_INT8_SHARE = 0.5  # the default budget: W8A8 on this share of the layers' quality cost


def parse_precisions(text: str) -> tuple[str, ...]:
    """'fp16,int8,int4' -> precisions, most bytes first (the reference); a user error if bad."""
    names = [name.strip().lower() for name in text.split(",")]
    if not text.strip() or any(not name for name in names):
        raise TesselError(
            f"--precisions {text!r}: empty precision; give a comma-separated list such as fp16,int8,int4"
        )
    unknown = [name for name in names if name not in PRECISIONS]
    if unknown:
        raise TesselError(
            f"--precisions: unknown precision {unknown[0]!r}; use some of {', '.join(PRECISIONS)}"
        )
    if len(set(names)) != len(names):
        raise TesselError(f"--precisions {text!r}: a precision is listed twice")
    return tuple(sorted(names, key=lambda name: (-L.weight_param_bytes(name), PRECISIONS.index(name))))


def default_budget(int8_quality: np.ndarray) -> float:
    """The budget with neither --quality-budget nor --theta: W8A8 on half of the layers' cost."""
    return DEFAULT_INT8_SHARE * float(np.sum(int8_quality))


def same_precision_costs(instance, a: int, b: int) -> bool:
    """Devices a and b cost the same at every precision (always true without a precision choice)."""
    choice = instance.precision
    if choice is None:
        return True
    return all(
        np.array_equal(times[:, a, :], times[:, b, :])
        for times in (choice.prefill_time_s, choice.decode_time_s)
    )


def stage_precision_text(names: tuple[str, ...] | None, unit_start: int, unit_end: int) -> str:
    """'fp16 x6, int8 x4' for the units of one stage ('' without a precision choice)."""
    if names is None:
        return ""
    counts: dict[str, int] = {}
    for name in names[unit_start:unit_end]:
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} x{count}" for name, count in counts.items())
