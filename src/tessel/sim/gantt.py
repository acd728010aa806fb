"""Gantt chart of a simulation: one row per stage, a box per compute interval and per transfer.

A compute box is split into horizontal stripes, one per request in the micro-batch, in that
request's colour, with heights proportional to its tokens (at least `MIN_STRIPE_SHARE` of the
box, so a decode step beside a long prefill chunk shows); a transfer is a thin hatched box under the
sending stage's row. The time axis is in ms when the chart spans under 2 s. The format follows the
file extension (.png, .svg, .pdf); matplotlib draws on its Agg canvas (no pyplot, no display, no
global backend change). Boxes go into a few PolyCollections (one artist per kind, not per box), so
charts of 10^5 intervals stay quick.

`default_window_s(result)` is where `tessel simulate --gantt` cuts a chart by default: a chart of
every micro-batch of 200 requests is thousands of slivers with no readable box, so past
`WINDOW_MICRO_BATCHES` micro-batches on stage 0 the chart shows the time until the end of that
many (the pipeline's fill and its steady state); `--gantt-until-s` draws any other window.
"""

from __future__ import annotations

from pathlib import Path

from tessel.errors import TesselError
from tessel.sim.simulator import SimResult

FORMATS = (".png", ".svg", ".pdf")
MS_AXIS_BELOW_S = 2.0  # switch the axis from ms to s at this span
LEGEND_MAX_REQUESTS = 16  # more entries than this make the legend unreadable
COMPUTE_HEIGHT = 0.62  # share of a row the compute boxes take; transfers sit below them
SEND_HEIGHT = 0.16
MIN_STRIPE_SHARE = 0.12  # a decode step (1 token) beside a long prefill chunk stays visible
WINDOW_MICRO_BATCHES = 48  # stage 0's micro-batches a default chart shows: boxes stay wider than a stroke


def check_gantt_path(path: str | Path) -> Path:
    """The path, if its extension names a format the chart can be written in."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise TesselError(f"Gantt chart {path}: unknown format {path.suffix!r} (use {', '.join(FORMATS)})")
    return path


def default_window_s(result: SimResult) -> float | None:
    """The end of the default chart window (seconds): None when the whole run is readable."""
    firsts = sorted(i.end_s for i in result.intervals if i.kind == "compute" and i.stage == 0)
    if len(firsts) <= WINDOW_MICRO_BATCHES:
        return None
    return firsts[WINDOW_MICRO_BATCHES - 1]


def plot_gantt(
    result: SimResult,
    path: str | Path,
    *,
    title: str | None = None,
    stage_labels: list[str] | None = None,
    until_s: float | None = None,
) -> Path:
    """Draw `result` into `path`; `until_s` cuts the chart at that time (seconds)."""
    path = check_gantt_path(path)
    if stage_labels is not None and len(stage_labels) != result.n_stages:
        raise ValueError(f"{len(stage_labels)} stage labels for {result.n_stages} stages")
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    intervals = [i for i in result.intervals if until_s is None or i.start_s < until_s]
    if not intervals:
        raise TesselError("nothing to draw: the simulation has no intervals in the chosen window")
    origin = min(interval.start_s for interval in intervals)
    end = max(interval.end_s if until_s is None else min(interval.end_s, until_s) for interval in intervals)
    scale, unit = (1e3, "ms") if end - origin < MS_AXIS_BELOW_S else (1.0, "s")
    cmap = colormaps["tab20"]
    colour = lambda request_id: cmap(request_id % cmap.N)

    n = result.n_stages
    fig = Figure(figsize=(12, 1.0 + 0.7 * n))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    stripes, stripe_colours, boxes, sends = [], [], [], []  # one collection each: fast for 10^5 boxes
    lift = (0.5 - COMPUTE_HEIGHT / 2 - 0.1) / 2  # compute boxes sit a little high, transfers below
    for interval in intervals:
        row = n - 1 - interval.stage  # stage 0 on top
        left = (interval.start_s - origin) * scale
        right = ((min(interval.end_s, until_s) if until_s else interval.end_s) - origin) * scale
        if interval.kind == "send":
            sends.append(_rectangle(left, right, row - 0.5 + 0.04, SEND_HEIGHT))
            continue
        total = sum(item.tokens for item in interval.items)
        weights = [max(item.tokens, MIN_STRIPE_SHARE * total) for item in interval.items]
        bottom = row - COMPUTE_HEIGHT / 2 + lift
        boxes.append(_rectangle(left, right, bottom, COMPUTE_HEIGHT))
        for item, weight in zip(interval.items, weights, strict=True):
            height = COMPUTE_HEIGHT * weight / sum(weights)
            stripes.append(_rectangle(left, right, bottom, height))
            stripe_colours.append(colour(item.request_id))
            bottom += height
    ax.add_collection(PolyCollection(stripes, facecolors=stripe_colours, linewidths=0))
    ax.add_collection(PolyCollection(boxes, facecolors="none", edgecolors="black", linewidths=0.3))
    if sends:
        ax.add_collection(
            PolyCollection(sends, facecolors="0.75", edgecolors="0.35", hatch="///", linewidths=0.4)
        )
    labels = stage_labels or [f"stage {s}" for s in range(n)]
    ax.set_yticks(range(n), labels[::-1])
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(0, (end - origin) * scale)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", linewidth=0.3, alpha=0.6)
    requests = sorted({item.request_id for i in intervals for item in i.items})
    handles = [Patch(color=colour(r), label=f"request {r}") for r in requests[:LEGEND_MAX_REQUESTS]]
    handles.append(Patch(facecolor="0.75", edgecolor="0.35", hatch="///", label="transfer"))
    if len(requests) > LEGEND_MAX_REQUESTS:
        handles.append(Patch(color="white", label=f"(+{len(requests) - LEGEND_MAX_REQUESTS} more requests)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    return path


def _rectangle(left: float, right: float, bottom: float, height: float) -> list[tuple[float, float]]:
    top = bottom + height
    return [(left, bottom), (left, top), (right, top), (right, bottom)]
