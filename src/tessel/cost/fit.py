"""Fitting measured layer times to the profile's forms, on relative error.

    prefill:  t(c, p) = a0 + a1*c + a2*p + a3*c*(p + c/2)
    decode:   t(B, S) = g(B) + b2*S      g piecewise-linear through knots at the measured batch sizes
                                         (`fit_decode_table`; `fit_decode`: g(B) = b0 + b1*B)

Coefficients are non-negative (each is a time per something; `tessel.cost.profile` refuses a fit
with a term outside [0, MAX_TERM_S], from a file or from here) and the fit minimises the sum of
squared *relative* residuals, sum ((pred - t) / t)^2, so that a 2 ms point counts as much as a
2 s one: non-negative least squares (scipy.optimize.nnls) on the rows of the design matrix divided
by t. Columns are rescaled to unit norm first (nnls is invariant to positive column scaling, and
the c*(p + c/2) column is ~1e6 times the constant one). Held-out points, chosen by
`heldout_split` before fitting and never seen by it, give the reported error.

The other priced components (embedding, LM head + sampling, per-step overhead, a transport's
message time) are affine in one size, `t(x) = c0 + c1*x`, fitted the same way (`fit_component`),
or piecewise-linear through the measured sizes (`table`).

Why tables: a decode step's GEMMs have M = batch rows, and the CPU's GEMM library processes M in
tiles of `ROW_BLOCK` rows, so the time of the decoder layer and of the LM head is a staircase in the
batch (flat within a tile, a jump from 16 to 17 rows and from 32 to 33); a line through the small
batches over-prices a full tile. The grids therefore time both sides of each tile edge, and those
sizes (with the smallest and largest) are *anchors*: always fitted, never held out, so the held-out
error measures interpolation inside a tile, where the table is used.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import nnls

from tessel.cost.profile import ComponentFit, DecodeFit, PrefillFit

HELDOUT_FRACTION = 0.25
MIN_FIT_SIZES = 7  # the fewest sizes `fit_component` fits: both ends, and five inside to hold one out of
ROW_BLOCK = 16  # rows per GEMM tile edge the row grids straddle (`row_anchors`)


def prefill_design(chunk_tokens: np.ndarray, offset_tokens: np.ndarray) -> np.ndarray:
    c = np.asarray(chunk_tokens, dtype=np.float64)
    p = np.asarray(offset_tokens, dtype=np.float64)
    return np.stack([np.ones_like(c), c, p, c * (p + c / 2)], axis=1)


def decode_design(batch_size: np.ndarray, sum_context_tokens: np.ndarray) -> np.ndarray:
    b = np.asarray(batch_size, dtype=np.float64)
    s = np.asarray(sum_context_tokens, dtype=np.float64)
    return np.stack([np.ones_like(b), b, s], axis=1)


def row_anchors(sizes: np.ndarray, block: int = ROW_BLOCK) -> np.ndarray:
    """Mask of the sizes a table must keep: the smallest, the largest, and both sides of each tile
    edge (multiples of `block` and one past them)."""
    x = np.asarray(sizes, dtype=np.float64)
    edge = (x >= block) & np.isin(np.mod(x, block), (0.0, 1.0))
    return edge | (x == x.min()) | (x == x.max())


def hat_design(x: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """[n, k] weights of the piecewise-linear function through `knots` (sorted, distinct) at `x`:
    interpolation between neighbours, the end segments extended beyond them (`ComponentFit.time_s`)."""
    x = np.asarray(x, dtype=np.float64)
    knots = np.asarray(knots, dtype=np.float64)
    design = np.zeros((len(x), len(knots)))
    if len(knots) == 1:
        design[:, 0] = 1.0
        return design
    seg = np.clip(np.searchsorted(knots, x, side="right") - 1, 0, len(knots) - 2)
    w = (x - knots[seg]) / (knots[seg + 1] - knots[seg])
    rows = np.arange(len(x))
    design[rows, seg] = 1 - w
    design[rows, seg + 1] = w
    return design


def anchored_split(
    anchors: np.ndarray, fraction: float = HELDOUT_FRACTION, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(fit, held-out) index sets where the held-out points are drawn from the non-anchors only:
    round(fraction * n) of them (at least 1 where any non-anchor exists)."""
    anchors = np.asarray(anchors, dtype=bool)
    free = np.flatnonzero(~anchors)
    if len(free) == 0:
        raise ValueError("every size is an anchor: need one that is not, to hold out")
    n_held = min(len(free), max(1, round(fraction * len(anchors))))
    held = np.sort(np.random.default_rng(seed).permutation(free)[:n_held])
    return np.setdiff1d(np.arange(len(anchors)), held), held


def nnls_relative(design: np.ndarray, times_s: np.ndarray) -> np.ndarray:
    """argmin_{x >= 0} sum_i ((design_i . x - t_i) / t_i)^2."""
    times_s = np.asarray(times_s, dtype=np.float64)
    if design.shape[0] != times_s.shape[0] or design.shape[0] == 0:
        raise ValueError("need one time per design row, and at least one row")
    if (times_s <= 0).any() or not np.isfinite(times_s).all():
        raise ValueError("measured times must be positive and finite")
    rows = design / times_s[:, None]
    scale = np.linalg.norm(rows, axis=0)
    scale[scale == 0] = 1.0
    solution, _ = nnls(rows / scale, np.ones(len(times_s)))
    return solution / scale


def fit_prefill(chunk_tokens: np.ndarray, offset_tokens: np.ndarray, times_s: np.ndarray) -> PrefillFit:
    a0, a1, a2, a3 = nnls_relative(prefill_design(chunk_tokens, offset_tokens), times_s)
    return PrefillFit(float(a0), float(a1), float(a2), float(a3))


def fit_decode(batch_size: np.ndarray, sum_context_tokens: np.ndarray, times_s: np.ndarray) -> DecodeFit:
    b0, b1, b2 = nnls_relative(decode_design(batch_size, sum_context_tokens), times_s)
    return DecodeFit(float(b0), float(b1), float(b2))


def fit_decode_table(
    batch_size: np.ndarray, sum_context_tokens: np.ndarray, times_s: np.ndarray
) -> DecodeFit:
    """t(B, S) = g(B) + b2*S, g the piecewise-linear function through knots at the distinct batch
    sizes (each knot's value >= 0, b2 >= 0), on relative error; b0 + b1*B summarises g (a line
    through the knot values, for the efficiencies a profile implies)."""
    b = np.asarray(batch_size, dtype=np.float64)
    s = np.asarray(sum_context_tokens, dtype=np.float64)
    knots = np.unique(b)
    if len(knots) < 2:
        return fit_decode(b, s, times_s)
    design = np.concatenate([hat_design(b, knots), s[:, None]], axis=1)
    solution = nnls_relative(design, times_s)
    values, b2 = solution[:-1], float(solution[-1])
    summary = np.maximum(values, 1e-12)
    b0, b1 = nnls_relative(np.stack([np.ones_like(knots), knots], axis=1), summary)
    table = [(float(k), float(v)) for k, v in zip(knots, values, strict=True)]
    return DecodeFit(float(b0), float(b1), b2, table)


def mean_relative_error(predicted_s: np.ndarray, measured_s: np.ndarray) -> float:
    predicted_s, measured_s = np.asarray(predicted_s, float), np.asarray(measured_s, float)
    return float(np.mean(np.abs(predicted_s - measured_s) / measured_s))


def heldout_split(
    n_points: int, fraction: float = HELDOUT_FRACTION, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint (fit, held-out) index sets; the fit keeps at least 4 points, held-out at least 1."""
    if n_points < 5:
        raise ValueError(f"need at least 5 points to fit 4 coefficients and hold one out, got {n_points}")
    order = np.random.default_rng(seed).permutation(n_points)
    n_held = min(max(1, round(fraction * n_points)), n_points - 4)
    return np.sort(order[n_held:]), np.sort(order[:n_held])


@dataclass(frozen=True, slots=True)
class FitReport:
    prefill: PrefillFit
    decode: DecodeFit
    prefill_heldout_error: float
    decode_heldout_error: float
    prefill_fit_error: float  # on the points the fit saw
    heldout_error: float  # mean relative error over all held-out points, prefill and decode
    n_prefill_points: int
    n_decode_points: int


def fit_measurements(
    prefill_points: np.ndarray,
    prefill_times_s: np.ndarray,
    decode_points: np.ndarray,
    decode_times_s: np.ndarray,
) -> FitReport:
    """Fit both forms on the non-held-out points; errors on the held-out ones.

    prefill_points: [n, 2] (chunk tokens, offset tokens); decode_points: [m, 2] (batch, sum context).
    Decode: a table in the batch (`fit_decode_table`), held out among the non-anchor batches
    (`row_anchors`): the smallest and largest batch and the tile edges are always fitted.
    """
    pre = np.asarray(prefill_points, dtype=np.float64)
    dec = np.asarray(decode_points, dtype=np.float64)
    pre_t, dec_t = np.asarray(prefill_times_s, float), np.asarray(decode_times_s, float)
    fit_i, held_i = heldout_split(len(pre))
    prefill = fit_prefill(pre[fit_i, 0], pre[fit_i, 1], pre_t[fit_i])
    anchors = row_anchors(dec[:, 0])
    dfit_i, dheld_i = heldout_split(len(dec), seed=1) if anchors.all() else anchored_split(anchors, seed=1)
    decode = fit_decode_table(dec[dfit_i, 0], dec[dfit_i, 1], dec_t[dfit_i])

    def prefill_pred(idx: np.ndarray) -> np.ndarray:
        return prefill_design(pre[idx, 0], pre[idx, 1]) @ np.array(
            [prefill.a0, prefill.a1, prefill.a2, prefill.a3]
        )

    decode_pred = np.array([decode.time_s(b, ctx) for b, ctx in dec[dheld_i]])
    held_errors = np.concatenate(
        [
            np.abs(prefill_pred(held_i) - pre_t[held_i]) / pre_t[held_i],
            np.abs(decode_pred - dec_t[dheld_i]) / dec_t[dheld_i],
        ]
    )
    return FitReport(
        prefill=prefill,
        decode=decode,
        prefill_heldout_error=mean_relative_error(prefill_pred(held_i), pre_t[held_i]),
        decode_heldout_error=mean_relative_error(decode_pred, dec_t[dheld_i]),
        prefill_fit_error=mean_relative_error(prefill_pred(fit_i), pre_t[fit_i]),
        heldout_error=float(held_errors.mean()),
        n_prefill_points=len(pre),
        n_decode_points=len(dec),
    )


def fit_component(
    sizes: np.ndarray,
    times_s: np.ndarray,
    unit: str,
    shape: dict[str, int] | None = None,
    *,
    table: bool = False,
    anchors: np.ndarray | None = None,
    seed: int = 2,
) -> ComponentFit:
    """`t(x) = c0 + c1*x` (c0, c1 >= 0) on the non-held-out points, or with `table` the line through
    them (`ComponentFit.knots`); its error on the held-out ones. The held-out points are interior
    ones (never the smallest or largest size), so a table interpolates them; with `anchors` (a mask
    over `sizes`, e.g. `row_anchors`) never those either."""
    x = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if len(x) != len(t) or len(np.unique(x)) != len(x):
        raise ValueError("need one time per size, and distinct sizes")
    order = np.argsort(x)
    x, t = x[order], t[order]
    if anchors is None:
        inner_fit, inner_held = heldout_split(len(x) - 2, seed=seed)
        fit_i = np.sort(np.concatenate([[0, len(x) - 1], inner_fit + 1]))
        held_i = inner_held + 1
    else:
        keep = np.asarray(anchors, dtype=bool)[order]
        keep[[0, -1]] = True
        fit_i, held_i = anchored_split(keep, seed=seed)
    design = np.stack([np.ones_like(x), x], axis=1)
    c0, c1 = nnls_relative(design[fit_i], t[fit_i])
    knots = [(float(a), float(b)) for a, b in zip(x[fit_i], t[fit_i], strict=True)] if table else []
    fit = ComponentFit(float(c0), float(c1), unit, 0.0, len(x), dict(shape or {}), knots)
    held = mean_relative_error(np.array([fit.time_s(v) for v in x[held_i]]), t[held_i])
    return replace(fit, heldout_rel_error=held)
