"""Small HiGHS helpers shared by the MILP and the DP's bounds: an LP from COO entries, and its value.

`highspy` is imported inside the functions, so importing the planner stays cheap.
"""

from __future__ import annotations

import numpy as np


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

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.passModel(highs_lp(cost, col_lower, col_upper, rows, cols, vals, row_lower, row_upper))
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return float(h.getInfo().objective_function_value)
