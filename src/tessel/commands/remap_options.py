"""The `--remap` options `tessel serve --plan` and `tessel simulate` share (one decision, one set of
flags: `tessel.plan.remap.remap_decision.RemapSettings`, which refuses NaN and out-of-range values
naming the flag, for the Python API too): a command takes them as one parameter,
`remap: RemapFlags = REMAP_OPTIONS`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import typer

from tessel.commands.options import OptionGroup, float_option
from tessel.errors import TesselError
from tessel.plan.remap.remap_decision import (
    MAX_HORIZON_S,
    MAX_INTERVAL_S,
    MIN_HORIZON_S,
    MIN_INTERVAL_S,
    RemapSettings,
)

RemapMode = Literal["off", "auto"]
_DEFAULTS = RemapSettings()

REMAP_OPTION = typer.Option(
    "off",
    "--remap",
    help="auto: watch each stage's measured step times and the workload against the plan's, re-plan when "
    "they drift and move to the new split live when its gain over --remap-horizon-s, after the cost of "
    "moving the weights, reaches --remap-threshold; off: never remap.",
)
REMAP_THRESHOLD_OPTION = float_option(
    _DEFAULTS.threshold, "--remap-threshold", low=0.0, high=1.0,
    help="Least gain (a fraction of the plan's objective, in [0, 1)) that pays for a remap.",
)  # fmt: skip
REMAP_HORIZON_OPTION = float_option(
    _DEFAULTS.horizon_s, "--remap-horizon-s", low=MIN_HORIZON_S, high=MAX_HORIZON_S,
    floor_reason="moving weights takes seconds: a remap amortised over less never pays",
    help="Seconds of serving a remap's weight-moving cost is amortised over.",
)  # fmt: skip
_INTERVAL_FLOOR = "the stages' counters arrive with their heartbeats, at most every 0.1 s"
REMAP_INTERVAL_OPTION = float_option(
    _DEFAULTS.interval_s, "--remap-interval-s", low=MIN_INTERVAL_S, high=MAX_INTERVAL_S,
    floor_reason=_INTERVAL_FLOOR, help="Seconds between two remap decisions.",
)  # fmt: skip
REMAP_WINDOW_OPTION = float_option(
    _DEFAULTS.window_s, "--remap-window-s", low=MIN_INTERVAL_S, high=MAX_INTERVAL_S,
    floor_reason=_INTERVAL_FLOOR,
    help="Seconds of measurements a decision reads (at least --remap-interval-s).",
)  # fmt: skip
REMAP_MIN_SLOWDOWN_OPTION = float_option(
    _DEFAULTS.min_slowdown, "--remap-min-slowdown", low=1.0, high=100.0,
    help="A stage this many times slower (or faster) than the plan assumed has drifted (> 1).",
)  # fmt: skip
REMAP_COOLDOWN_OPTION = float_option(
    _DEFAULTS.cooldown_s, "--remap-cooldown-s", low=0.0, high=MAX_HORIZON_S,
    help="No remap within this many seconds of the last one.",
)  # fmt: skip
REMAP_CONFIRM_OPTION = typer.Option(
    _DEFAULTS.confirm, "--remap-confirm", min=1, max=1000,
    help="Decisions in a row that must want the same new split before it is taken.",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RemapFlags:
    mode: RemapMode
    settings: RemapSettings


def remap_flags(remap: RemapMode, **flags: float) -> RemapFlags:
    """The mode and settings the flags give: `--remap-X` is `RemapSettings.X` (refused naming the flag);
    with --remap off, no --remap-* flag may differ from its default."""
    settings = RemapSettings(**{name.removeprefix("remap_"): value for name, value in flags.items()})
    if remap == "off":
        changed = [
            f"--remap-{name.replace('_', '-')}"
            for name in ("threshold", "horizon_s", "min_slowdown", "cooldown_s", "confirm")
            if getattr(settings, name) != getattr(_DEFAULTS, name)
        ]
        if changed:
            raise TesselError(f"{', '.join(changed)} set a remap decision; give --remap auto too")
    return RemapFlags(remap, settings)


REMAP_OPTIONS = OptionGroup(
    {
        "remap": (RemapMode, REMAP_OPTION),
        "remap_threshold": (float, REMAP_THRESHOLD_OPTION),
        "remap_horizon_s": (float, REMAP_HORIZON_OPTION),
        "remap_interval_s": (float, REMAP_INTERVAL_OPTION),
        "remap_window_s": (float, REMAP_WINDOW_OPTION),
        "remap_min_slowdown": (float, REMAP_MIN_SLOWDOWN_OPTION),
        "remap_cooldown_s": (float, REMAP_COOLDOWN_OPTION),
        "remap_confirm": (int, REMAP_CONFIRM_OPTION),
    },
    remap_flags,
)
