"""Piecewise-linear fits (tables) for what is a staircase in its rows or sizes: the decode layer's
table in the batch (`fit_decode_table`), the anchored held-out split that never leaves out a tile
edge, tables of the components, and the profile file carrying decode knots (old files still read)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tessel.cost.fit import (
    anchored_split,
    fit_component,
    fit_decode,
    fit_decode_table,
    fit_measurements,
    hat_design,
    row_anchors,
)
from tessel.cost.profile import DecodeFit, PrefillFit, Profile, load_profile
from tessel.errors import TesselError

BATCHES = np.array([1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32], float)


def _stairs(batch: np.ndarray) -> np.ndarray:
    """A GEMM-like layer time: a per-row part plus a jump at each 16-row tile edge."""
    b = np.asarray(batch, float)
    return 2e-3 + 8e-5 * b + 9e-4 * (np.ceil(b / 16) - 1) - 2e-5 * np.maximum(b - 16, 0)


def _decode_points(rng: np.random.Generator, noise: float) -> tuple[np.ndarray, np.ndarray, float]:
    contexts = np.array([32.0, 128.0])
    batch = np.repeat(BATCHES, len(contexts))
    total = batch * np.tile(contexts, len(BATCHES))
    b2 = 3e-8
    times = (_stairs(batch) + b2 * total) * (1 + noise * rng.standard_normal(len(batch)))
    return np.stack([batch, total], axis=1), times, b2


def test_row_anchors_are_the_ends_and_both_sides_of_each_tile_edge() -> None:
    x = np.array([1, 2, 3, 8, 15, 16, 17, 18, 31, 32, 33, 40, 48, 49, 50], float)
    assert list(x[row_anchors(x)]) == [1, 16, 17, 32, 33, 48, 49, 50]


def test_anchored_split_holds_out_only_free_points_and_is_disjoint() -> None:
    anchors = row_anchors(BATCHES)
    for seed in range(5):
        fit_i, held_i = anchored_split(anchors, seed=seed)
        assert set(fit_i).isdisjoint(held_i) and sorted([*fit_i, *held_i]) == list(range(len(BATCHES)))
        assert len(held_i) == round(0.25 * len(BATCHES)) and not anchors[held_i].any()
    with pytest.raises(ValueError, match="anchor"):
        anchored_split(np.ones(4, bool))


def test_hat_design_interpolates_as_the_profile_evaluates_knots() -> None:
    knots = np.array([1.0, 4.0, 16.0, 17.0])
    values = np.array([1.0, 2.0, 2.5, 4.0])
    fit = DecodeFit(0.0, 0.0, 0.0, list(zip(knots, values, strict=True)))
    x = np.array([1.0, 2.5, 4.0, 10.0, 16.5, 17.0, 20.0])
    design = hat_design(x, knots)
    np.testing.assert_allclose(design.sum(axis=1), 1.0)
    np.testing.assert_allclose(design @ values, [fit.time_s(v, 0.0) for v in x])


def test_decode_table_recovers_a_staircase_the_affine_form_over_prices() -> None:
    rng = np.random.default_rng(4)
    points, times, b2 = _decode_points(rng, 0.0)
    table = fit_decode_table(points[:, 0], points[:, 1], times)
    predicted = np.array([table.time_s(b, s) for b, s in points])
    np.testing.assert_allclose(predicted, times, rtol=1e-6)
    assert table.b2 == pytest.approx(b2, rel=1e-4)
    assert [b for b, _ in table.knots] == list(BATCHES)
    # the line of the old form, fitted on relative error, misses the tile edges
    affine = fit_decode(points[:, 0], points[:, 1], times)
    assert np.max(np.abs(affine.time_s(points[:, 0], points[:, 1]) / times - 1)) > 0.05
    # with noise of 1%, every batch within a few percent
    noisy_points, noisy, _ = _decode_points(rng, 0.01)
    fit = fit_decode_table(noisy_points[:, 0], noisy_points[:, 1], noisy)
    for b in BATCHES:
        assert fit.time_s(b, b * 80) == pytest.approx(_stairs(b) + b2 * b * 80, rel=0.03)


def test_fit_measurements_holds_out_decode_points_the_table_never_sees() -> None:
    rng = np.random.default_rng(6)
    c = rng.choice([16, 32, 64, 128, 256], size=24).astype(float)
    p = rng.choice([0, 64, 128], size=24).astype(float)
    pre_t = PrefillFit(3e-4, 4e-6, 2e-9, 3e-10).time_s(c, p)
    points, times, _ = _decode_points(rng, 0.0)
    clean = fit_measurements(np.stack([c, p], axis=1), pre_t, points, times)
    assert clean.decode_heldout_error < 0.02 and clean.decode.knots  # interpolated inside a tile
    _, held = anchored_split(row_anchors(points[:, 0]), seed=1)
    assert not row_anchors(points[:, 0])[held].any()
    damaged = times.copy()
    damaged[held] *= 1.5
    report = fit_measurements(np.stack([c, p], axis=1), pre_t, points, damaged)
    assert report.decode == clean.decode  # the fit never saw them
    assert report.decode_heldout_error > 0.25


def test_component_table_with_anchors_follows_the_head_staircase() -> None:
    rows = np.array([1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32, 33, 48, 49, 64], float)
    times = 9e-3 + 4e-4 * rows + 7e-3 * (np.ceil(rows / 16) - 1)
    table = fit_component(rows, times, "rows", table=True, anchors=row_anchors(rows))
    affine = fit_component(rows, times, "rows")
    assert table.heldout_rel_error < 1e-9 < affine.heldout_rel_error
    assert table.time_s(17) == pytest.approx(times[8]) and table.time_s(33) == pytest.approx(times[11])
    assert {x for x, _ in table.knots} >= set(rows[row_anchors(rows)])


def _profile(decode: DecodeFit) -> Profile:
    return Profile("cpu", {"hidden_size": 64}, "fp32", PrefillFit(1e-3, 1e-5, 0.0, 0.0), decode, 0.02)


def test_decode_knots_round_trip_and_a_file_without_them_still_loads(tmp_path) -> None:
    with_knots = _profile(DecodeFit(2e-3, 1e-4, 1e-8, [(1.0, 2e-3), (16.0, 3e-3), (17.0, 4e-3)]))
    path = tmp_path / "p.json"
    with_knots.save(path)
    loaded = load_profile(path)
    assert loaded.decode == with_knots.decode and loaded.decode.time_s(16.5, 0) == pytest.approx(3.5e-3)
    data = json.loads(path.read_text())
    del data["decode"]["knots"]  # as version-2 files written before the tables
    path.write_text(json.dumps(data))
    assert load_profile(path).decode == DecodeFit(2e-3, 1e-4, 1e-8)
    data["decode"]["knots"] = [[4, 1e-3], [2, 1e-3]]
    path.write_text(json.dumps(data))
    with pytest.raises(TesselError, match="decode.knots"):
        load_profile(path)
