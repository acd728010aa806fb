"""The profile fits: known coefficients come back from noisy synthetic timings; held-out is disjoint."""

from __future__ import annotations

import numpy as np
import pytest

from tessel.cost.fit import (
    fit_decode,
    fit_measurements,
    fit_prefill,
    heldout_split,
    nnls_relative,
    prefill_design,
)
from tessel.cost.profile import DecodeFit, PrefillFit


def _grid(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    c = rng.choice([16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048], size=n)
    p = rng.choice([0, 128, 512, 1024, 4096, 8192, 16384], size=n)
    return c.astype(float), p.astype(float)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefill_fit_recovers_known_coefficients(seed: int) -> None:
    rng = np.random.default_rng(seed)
    truth = PrefillFit(
        a0=float(rng.uniform(1e-4, 1e-3)),
        a1=float(rng.uniform(1e-6, 1e-5)),
        a2=float(rng.uniform(1e-9, 1e-8)),
        a3=float(rng.uniform(1e-10, 1e-9)),
    )
    c, p = _grid(rng, 400)
    noise = 1 + 0.01 * rng.standard_normal(len(c))
    fit = fit_prefill(c, p, truth.time_s(c, p) * noise)
    for name in ("a0", "a1", "a3"):  # a2 only moves times by <1% here: loosely
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), rel=0.05), name
    assert fit.a2 == pytest.approx(truth.a2, rel=0.5, abs=2e-9)
    # noiseless data: exact
    exact = fit_prefill(c, p, truth.time_s(c, p))
    np.testing.assert_allclose(
        [exact.a0, exact.a1, exact.a2, exact.a3], [truth.a0, truth.a1, truth.a2, truth.a3], rtol=1e-6
    )


def test_decode_fit_recovers_known_coefficients() -> None:
    rng = np.random.default_rng(5)
    truth = DecodeFit(b0=2e-3, b1=3e-5, b2=4e-8)
    batch = rng.choice([1, 2, 4, 8, 16, 32, 64], size=200).astype(float)
    context = batch * rng.choice([128, 512, 2048, 8192, 32768], size=200)
    times = truth.time_s(batch, context) * (1 + 0.01 * rng.standard_normal(200))
    fit = fit_decode(batch, context, times)
    np.testing.assert_allclose([fit.b0, fit.b1, fit.b2], [truth.b0, truth.b1, truth.b2], rtol=0.05)


def test_fit_is_non_negative_and_minimises_relative_error() -> None:
    """A term the data does not need is 0, not negative; and the relative-error objective at the
    answer is no worse than at nearby non-negative points (the NNLS optimality check)."""
    rng = np.random.default_rng(8)
    c, p = _grid(rng, 120)
    times = 5e-4 + 2e-6 * c  # no offset or attention term at all
    fit = fit_prefill(c, p, times * (1 + 0.02 * rng.standard_normal(len(c))))
    assert min(fit.a0, fit.a1, fit.a2, fit.a3) >= 0.0
    design = prefill_design(c, p)
    target = times * (1 + 0.02 * rng.standard_normal(len(c)))
    x = nnls_relative(design, target)

    def loss(v: np.ndarray) -> float:
        return float(((((design @ v) - target) / target) ** 2).sum())

    for _ in range(50):
        trial = np.maximum(x * (1 + 0.01 * rng.standard_normal(4)) + 1e-12 * rng.random(4), 0.0)
        assert loss(trial) >= loss(x) * (1 - 1e-9)


def test_heldout_split_is_disjoint_and_covers_everything() -> None:
    for n in (5, 9, 40, 101):
        fit_i, held_i = heldout_split(n)
        assert set(fit_i).isdisjoint(held_i)
        assert sorted([*fit_i, *held_i]) == list(range(n))
        assert len(held_i) >= 1 and len(fit_i) >= 4
    with pytest.raises(ValueError):
        heldout_split(4)


def test_fit_measurements_reports_heldout_error_from_unseen_points() -> None:
    """Corrupt only held-out points: the fit is unchanged and the held-out error sees the damage."""
    rng = np.random.default_rng(3)
    truth = PrefillFit(3e-4, 4e-6, 2e-9, 3e-10)
    c, p = _grid(rng, 60)
    dec_truth = DecodeFit(1e-3, 2e-5, 3e-8)
    batch = rng.choice([1, 2, 4, 8], size=30).astype(float)
    context = batch * rng.choice([256, 1024, 4096], size=30)
    pre_t, dec_t = truth.time_s(c, p), dec_truth.time_s(batch, context)
    points = np.stack([c, p], axis=1)
    dec_points = np.stack([batch, context], axis=1)
    clean = fit_measurements(points, pre_t, dec_points, dec_t)
    assert clean.heldout_error < 1e-6 and clean.prefill_fit_error < 1e-6
    _, held = heldout_split(len(c))
    damaged = pre_t.copy()
    damaged[held] *= 1.5
    report = fit_measurements(points, damaged, dec_points, dec_t)
    assert report.prefill == clean.prefill  # the fit never saw them: bit-identical
    assert report.prefill_heldout_error == pytest.approx(0.5 / 1.5, rel=1e-6)


def test_bad_times_are_rejected() -> None:
    with pytest.raises(ValueError):
        nnls_relative(np.ones((3, 2)), np.array([1.0, 0.0, 2.0]))
    with pytest.raises(ValueError):
        nnls_relative(np.ones((3, 2)), np.array([1.0, 2.0]))
