"""The HiGHS helpers every solver goes through: a model built from column blocks and COO rows
(`ModelBuilder`), its build-solve-read sequence under a deadline (`solve_mip`, the planning MILP's and
the flow MILP's), an LP from COO entries (`highs_lp`) and a small LP's value (`solve_lp`).

`highspy` is imported inside the functions, so importing the planner stays cheap. Every solver is
made by `new_highs`: HiGHS prints its banner ("Running HiGHS ...") to the process's stdout from C
when the first one is constructed, before any option can be set, so that construction runs with
file descriptor 1 pointed at /dev/null; output is then off unless asked for (`verbose`).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

FEASIBLE = 2  # HiGHS's primal_solution_status when it holds a feasible solution (kSolutionStatusFeasible)

_banner_lock = threading.Lock()
_banner_silenced = False  # the banner is printed once per process, by the first Highs()


def new_highs(verbose: bool = False):
    """A `highspy.Highs` that prints nothing (with `verbose`: HiGHS's log, without its banner)."""
    import highspy

    global _banner_silenced
    with _banner_lock:
        if _banner_silenced:
            h = highspy.Highs()
        else:
            with _stdout_to_devnull():
                h = highspy.Highs()
            _banner_silenced = True
    h.setOptionValue("output_flag", bool(verbose))
    return h


def run_until(h, deadline_s: float) -> str:
    """Run `h` until it ends or `time.perf_counter()` passes `deadline_s`; its status in words
    ("Time limit reached" when interrupted). HiGHS checks its own time limit only between phases, so
    long root LPs and cut loops overrun it: its interrupt callbacks check the deadline too."""
    import highspy

    def stop_at_deadline(event) -> None:
        if time.perf_counter() > deadline_s:
            event.interrupt()

    h.cbMipInterrupt += stop_at_deadline
    h.cbSimplexInterrupt += stop_at_deadline
    h.cbIpmInterrupt += stop_at_deadline
    h.run()
    if h.getModelStatus() == highspy.HighsModelStatus.kInterrupt:
        return "Time limit reached"
    return h.modelStatusToString(h.getModelStatus())


@contextmanager
def _stdout_to_devnull() -> Iterator[None]:
    """File descriptor 1 on /dev/null for the block (C's printf included), then back."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout at all: nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        ctypes.CDLL(None).fflush(None)  # what C buffered goes to /dev/null, not to the restored stdout
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def highs_lp(cost, col_lower, col_upper, rows, cols, vals, row_lower, row_upper, integer=None):
    """A HighsLp from COO entries (column-wise CSC built with numpy; no scipy import)."""
    import highspy

    n_cols, n_rows = len(cost), len(row_lower)
    # sum duplicate (row, col) entries (a row may name a column twice); HiGHS needs them merged
    keys, inverse = np.unique(
        np.asarray(cols, dtype=np.int64) * n_rows + np.asarray(rows), return_inverse=True
    )
    merged = np.zeros(len(keys))
    np.add.at(merged, inverse, np.asarray(vals, dtype=float))
    cols, rows, vals = keys // n_rows, keys % n_rows, merged
    order = np.arange(len(keys))  # np.unique sorted the keys: by column, then row
    counts = np.bincount(cols, minlength=n_cols)
    lp = highspy.HighsLp()
    lp.num_col_ = n_cols
    lp.num_row_ = n_rows
    lp.col_cost_ = np.asarray(cost, dtype=float)
    lp.col_lower_ = np.asarray(col_lower, dtype=float)
    lp.col_upper_ = np.asarray(col_upper, dtype=float)
    lp.row_lower_ = np.asarray(row_lower, dtype=float)
    lp.row_upper_ = np.asarray(row_upper, dtype=float)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    lp.a_matrix_.index_ = np.asarray(rows, dtype=np.int32)[order]
    lp.a_matrix_.value_ = np.asarray(vals, dtype=float)[order]
    if integer is not None:
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if flag else highspy.HighsVarType.kContinuous for flag in integer
        ]
    return lp


def solve_lp(cost, col_lower, col_upper, rows, cols, vals, row_lower, row_upper) -> float | None:
    """Optimal value of a small LP, or None when HiGHS finds none."""
    import highspy

    h = new_highs()
    h.passModel(highs_lp(cost, col_lower, col_upper, rows, cols, vals, row_lower, row_upper))
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return float(h.getInfo().objective_function_value)


class ModelBuilder:
    """Columns and COO rows of a MILP, in the order they are added."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cost: list[float] = []
        self.integer: list[bool] = []
        self.rows_lo: list[float] = []
        self.rows_hi: list[float] = []
        self.r: list[np.ndarray] = []
        self.c: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.n_rows = 0

    @property
    def n_cols(self) -> int:
        return len(self.lower)

    def cols(self, shape, lo=0.0, hi=np.inf, integer=False) -> np.ndarray:
        count = int(np.prod(shape))
        start = len(self.lower)
        self.lower += [lo] * count
        self.upper += [hi] * count
        self.cost += [0.0] * count
        self.integer += [integer] * count
        return np.arange(start, start + count).reshape(shape)

    def rows(self, cols: np.ndarray, vals: np.ndarray, lo, hi) -> None:
        """Rows given as [n_rows, k] column / value arrays (dense per row; zero values dropped)."""
        cols = np.atleast_2d(np.asarray(cols))
        vals = np.broadcast_to(np.asarray(vals, dtype=float), cols.shape)
        n = cols.shape[0]
        rows = np.broadcast_to(np.arange(self.n_rows, self.n_rows + n)[:, None], cols.shape)
        keep = vals != 0.0
        self.r.append(rows[keep])
        self.c.append(cols[keep])
        self.v.append(vals[keep])
        self.rows_lo += list(np.broadcast_to(np.asarray(lo, dtype=float), (n,)))
        self.rows_hi += list(np.broadcast_to(np.asarray(hi, dtype=float), (n,)))
        self.n_rows += n

    def lp(self, cost_divisor: float = 1.0):
        """The model as a HighsLp, its costs divided by `cost_divisor` (built in other units)."""
        return highs_lp(
            np.asarray(self.cost) / cost_divisor,
            np.asarray(self.lower),
            np.asarray(self.upper),
            np.concatenate(self.r),
            np.concatenate(self.c),
            np.concatenate(self.v),
            np.asarray(self.rows_lo),
            np.asarray(self.rows_hi),
            np.asarray(self.integer),
        )


@dataclass(frozen=True, slots=True)
class MipOutcome:
    """What HiGHS found for a `ModelBuilder`'s MILP (minimised)."""

    status: str  # HiGHS's model status in words, "Time limit reached" when the deadline stopped it
    values: np.ndarray | None  # every column's value in the best solution found; None: none found
    objective: float  # of `values` (meaningless when there are none)
    dual_bound: float  # HiGHS's MIP dual bound (may be infinite)
    warm_started: bool  # HiGHS accepted the start values


def solve_mip(
    model: ModelBuilder,
    *,
    started: float,
    time_limit_s: float,
    mip_gap: float,
    cost_divisor: float = 1.0,
    start: np.ndarray | None = None,
    threads: int | None = None,
    verbose: bool = False,
) -> MipOutcome:
    """Build, solve and read `model` with HiGHS until `started + time_limit_s` (`time.perf_counter()`
    seconds): HiGHS's own time limit is what is left of it (at least 0.1 s); `start` (a value per
    column) is handed to it as a warm start."""
    import highspy

    lp = model.lp(cost_divisor)
    h = new_highs(verbose)
    h.setOptionValue("time_limit", float(max(time_limit_s - (time.perf_counter() - started), 0.1)))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    if threads is not None:
        h.setOptionValue("threads", int(threads))
    h.passModel(lp)
    warm = False
    if start is not None:
        solution = highspy.HighsSolution()
        solution.col_value = start
        solution.value_valid = True
        warm = h.setSolution(solution) == highspy.HighsStatus.kOk
    status = run_until(h, started + time_limit_s)
    info = h.getInfo()
    values = np.asarray(h.getSolution().col_value) if info.primal_solution_status == FEASIBLE else None
    return MipOutcome(status, values, float(info.objective_function_value), float(info.mip_dual_bound), warm)
