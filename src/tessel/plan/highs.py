"""Small HiGHS helpers shared by the MILP and the DP's bounds: an LP from COO entries, and its value.

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

import numpy as np

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
