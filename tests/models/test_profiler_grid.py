"""The profiler's grids: decode batches straddle the GEMM tile edges at two contexts or more, a
thinned grid keeps those anchors, and a transport size's time is the clean mode of its ping-pongs."""

from __future__ import annotations

import numpy as np

from tessel.cost.fit import row_anchors
from tessel.profiling.components import HEAD_ROWS, clean_statistic
from tessel.profiling.layer import ProfileSettings, choose_points, decode_anchor_points, decode_grid


def test_decode_grid_straddles_tile_edges_at_two_contexts() -> None:
    grid = decode_grid(ProfileSettings(max_decode_batch=32, max_decode_context=160))
    batches = sorted({b for b, _ in grid})
    assert {1, 16, 17, 32} <= set(batches) and max(batches) == 32
    assert all(len({s // b for b2, s in grid if b2 == b}) >= 2 for b in batches)
    assert max(b for b, _ in decode_grid(ProfileSettings(max_decode_batch=20))) == 20
    assert {16, 17, 32, 33, 48, 49} <= set(HEAD_ROWS)


def test_a_thinned_decode_grid_keeps_its_anchors() -> None:
    grid = decode_grid(ProfileSettings(max_decode_batch=64, max_decode_context=4096))
    keep = decode_anchor_points(grid)
    anchors = row_anchors(np.array([b for b, _ in grid], float))
    longest = max(s // b for b, s in grid)
    at_longest = [i for i in keep if grid[i][1] // grid[i][0] == longest]
    assert {grid[i][0] for i in at_longest} == {1, 16, 17, 32, 33, 48, 49, 64}
    assert all(anchors[i] for i in at_longest)
    assert {grid[i][0] for i in keep} == {b for b, _ in grid}  # every batch, at the shortest context
    chosen = choose_points(grid, lambda b, s: 1.0 + s / 1e4, budget_s=5.0, minimum=6, keep=keep)
    assert {grid[i] for i in keep} <= set(chosen) and len(chosen) < len(grid)


def test_clean_statistic_is_the_clean_mode_of_a_loaded_host() -> None:
    rng = np.random.default_rng(0)
    clean = 150e-6 * (1 + 0.05 * rng.standard_normal(40))
    waited = clean + np.where(np.arange(40) % 5 < 3, rng.uniform(1e-3, 8e-3, 40), 0.0)  # 60% waited
    assert np.median(waited) > 1e-3  # the median of all is the waiting mode
    assert abs(clean_statistic(list(waited)) / 150e-6 - 1) < 0.1
