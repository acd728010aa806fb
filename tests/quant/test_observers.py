"""Observers against their references.

- MinMax, per-channel MinMax, moving-average MinMax: torch.ao.quantization's observers, bit for bit
  (same scale and zero point) for symmetric and asymmetric int8 and int4 ranges.
- entropy: a direct loop over TensorRT's published KL algorithm (below), on the same histogram.
- mse: a direct grid search that quantises the raw values for every candidate clip.
- percentile: the empirical CDF of |x| (smallest v with F(v) >= p), within one histogram bin.
- the histogram: numpy's histogram of |x| (up to values on a bin edge), in any batch order.
Distributions: skewed (log-normal), outlier-heavy (Student t with 2 degrees of freedom, a few
x100 spikes), Gaussian.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization import MinMaxObserver as AoMinMax
from torch.ao.quantization import MovingAverageMinMaxObserver as AoMovingAverage
from torch.ao.quantization import MovingAveragePerChannelMinMaxObserver as AoMovingAveragePerChannel
from torch.ao.quantization import PerChannelMinMaxObserver as AoPerChannel

from tessel.errors import TesselError
from tessel.models.quantized.qparams import QuantRange, calculate_qparams, dequantize_tensor, quantize_tensor
from tessel.quant.observers import (
    HISTOGRAM_BINS,
    KL_LEVELS,
    EntropyObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MSEObserver,
    PercentileObserver,
    make_observer,
    mse_candidates,
)

RANGES = [
    QuantRange(8, True),
    QuantRange(8, False),
    QuantRange(4, True),
    QuantRange(4, False),
    QuantRange(8, True, code_bits=7),  # int8 storage, codes in [-63, 63] (AVX2's fbgemm)
]


def _distribution(kind: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(shape, generator=g)
    if kind == "skewed":  # log-normal, all positive, long right tail
        return torch.exp(torch.randn(shape, generator=g) * 0.8) - 0.3
    # outliers: Student t (2 dof) plus a few spikes 100x the scale
    x = torch.distributions.StudentT(2.0).sample(shape)
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 2000),), generator=g)
    flat[idx] *= 100
    return x


KINDS = ["gaussian", "skewed", "outliers"]


def _ao_kwargs(qrange: QuantRange, per_channel: bool) -> dict:
    if qrange.symmetric:
        scheme = torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric
    else:
        scheme = torch.per_channel_affine if per_channel else torch.per_tensor_affine
    return dict(dtype=torch.qint8, qscheme=scheme, quant_min=qrange.qmin, quant_max=qrange.qmax)


@pytest.mark.parametrize("qrange", RANGES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_minmax_matches_torch_ao_bit_for_bit(qrange: QuantRange, kind: str) -> None:
    ours, ao = MinMaxObserver(qrange), AoMinMax(**_ao_kwargs(qrange, False))
    for seed in range(3):
        x = _distribution(kind, (37, 53), seed)
        ours.observe(x)
        ao(x)
    scale, zp = ours.qparams()
    ao_scale, ao_zp = ao.calculate_qparams()
    assert torch.equal(scale.reshape(-1), ao_scale.reshape(-1).float())
    assert torch.equal(zp.reshape(-1).long(), ao_zp.reshape(-1).long())


@pytest.mark.parametrize("qrange", RANGES, ids=str)
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_per_channel_minmax_matches_torch_ao_bit_for_bit(qrange: QuantRange, axis: int, kind: str) -> None:
    ours = MinMaxObserver(qrange, axis=axis)
    ao = AoPerChannel(ch_axis=axis, **_ao_kwargs(qrange, True))
    for seed in range(2):
        x = _distribution(kind, (29, 7, 11), seed)
        ours.observe(x)
        ao(x)
    scale, zp = ours.qparams()
    ao_scale, ao_zp = ao.calculate_qparams()
    assert torch.equal(scale, ao_scale.float())
    assert torch.equal(zp.long(), ao_zp.long())


@pytest.mark.parametrize("qrange", RANGES, ids=str)
@pytest.mark.parametrize("per_channel", [False, True])
def test_moving_average_matches_torch_ao_bit_for_bit(qrange: QuantRange, per_channel: bool) -> None:
    c = 0.05
    if per_channel:
        ours = MovingAverageMinMaxObserver(qrange, axis=0, averaging_constant=c)
        ao = AoMovingAveragePerChannel(averaging_constant=c, ch_axis=0, **_ao_kwargs(qrange, True))
    else:
        ours = MovingAverageMinMaxObserver(qrange, averaging_constant=c)
        ao = AoMovingAverage(averaging_constant=c, **_ao_kwargs(qrange, False))
    for seed in range(6):
        x = _distribution(KINDS[seed % 3], (19, 41), seed)
        ours.observe(x)
        ao(x)
    scale, zp = ours.qparams()
    ao_scale, ao_zp = ao.calculate_qparams()
    assert torch.equal(scale.reshape(-1), ao_scale.reshape(-1).float())
    assert torch.equal(zp.reshape(-1).long(), ao_zp.reshape(-1).long())


@pytest.mark.parametrize("qrange", RANGES, ids=str)
def test_quantize_matches_torch_quantize_per_channel(qrange: QuantRange) -> None:
    x = _distribution("outliers", (23, 31), 5)
    obs = MinMaxObserver(qrange, axis=0)
    obs.observe(x)
    scale, zp = obs.qparams()
    ref = torch.quantize_per_channel(x, scale.double(), zp.long(), 0, torch.qint8).int_repr()
    ref = ref.clamp(qrange.qmin, qrange.qmax)  # torch's qint8 range is [-128, 127]
    q = quantize_tensor(x, scale[:, None], zp[:, None], qrange)
    assert torch.equal(q, ref)
    err = (dequantize_tensor(q, scale[:, None], zp[:, None]) - x).abs()
    assert torch.all(err <= scale[:, None] / 2 * (1 + 1e-5))  # minmax never clips


def test_histogram_equals_numpy_histogram_in_any_batch_order() -> None:
    batches = [_distribution(k, (300,), s) * (10**s) for s, k in enumerate(KINDS)]
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        obs = EntropyObserver(QuantRange())
        for i in order:
            obs.observe(batches[i])
        h = obs.histogram
        values = torch.cat(batches).abs().double().numpy()
        clipped = np.minimum(values, h.upper * (1 - 1e-15))
        ref, _ = np.histogram(clipped, bins=HISTOGRAM_BINS, range=(0, h.upper))
        # equal up to values that sit on a bin edge (floor(v / width) in float64 vs numpy's rule)
        assert h.counts.sum() == ref.sum()
        assert np.abs(np.cumsum(h.counts) - np.cumsum(ref)).max() <= 2
        assert h.upper >= values.max()


def test_percentile_within_one_bin_of_numpy() -> None:
    for kind in KINDS:
        x = _distribution(kind, (5000,), 3)
        for p in (99.0, 99.9, 99.99):
            obs = PercentileObserver(QuantRange(), percentile=p)
            obs.observe(x[:2000])
            obs.observe(x[2000:])
            t = obs.threshold()
            a = x.abs().double().numpy()
            # t is the upper edge of the bin holding the smallest v with F(v) >= p
            assert np.mean(a <= t) >= p / 100 - 1e-12, (kind, p)
            assert np.mean(a <= t - obs.histogram.bin_width) < p / 100 + 1e-12, (kind, p)


# ---- TensorRT entropy calibration, written out as published (NVIDIA, "8-bit Inference with TensorRT",
# GTC 2017), as a plain loop: P = bins[0:i] with the outliers added to bin i-1, normalised; Q = bins[0:i]
# quantised into 128 levels and expanded back over the non-zero bins of each level, normalised;
# divergence = KL(P || Q); threshold = (argmin i) * bin width.
def _reference_kl(bins: np.ndarray) -> list[tuple[int, float]]:
    out = []
    for i in range(KL_LEVELS, len(bins) + 1):
        p = [float(b) for b in bins[:i]]
        p[i - 1] += float(sum(bins[i:]))
        level_of = [k * KL_LEVELS // i for k in range(i)]
        q = [0.0] * i
        for level in range(KL_LEVELS):
            members = [k for k in range(i) if level_of[k] == level]
            total = sum(bins[k] for k in members)
            nonzero = [k for k in members if bins[k] != 0]
            for k in nonzero:
                q[k] = total / len(nonzero)
        ps, qs = sum(p), sum(q)
        kl = 0.0
        for pk, qk in zip(p, q, strict=True):
            if pk == 0:
                continue
            if qk == 0:
                kl = math.inf
                break
            kl += pk / ps * math.log((pk / ps) / (qk / qs))
        out.append((i, kl))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_entropy_picks_the_kl_minimum_of_the_published_algorithm(kind: str) -> None:
    obs = EntropyObserver(QuantRange())
    obs.observe(_distribution(kind, (20000,), 11))
    counts = obs.histogram.counts
    used = int(np.max(np.nonzero(counts)[0])) + 1
    # the slow loop takes minutes on 2048 bins: merge the histogram 4:1 (an exact histogram too)
    coarse = counts[: used + (-used % 4)].reshape(-1, 4).sum(axis=1)
    reference = _reference_kl(coarse)
    best_kl = min(kl for _, kl in reference)
    from tessel.quant.observers import kl_divergences

    cuts, divergences = kl_divergences(coarse)
    assert [i for i, _ in reference] == list(cuts)
    for (_, ref), ours in zip(reference, divergences, strict=True):
        assert ours == pytest.approx(ref, rel=1e-9, abs=1e-12) or (math.isinf(ref) and math.isinf(ours))
    ours_best = len(divergences) - 1 - int(np.argmin(divergences[::-1]))
    assert divergences[ours_best] == pytest.approx(best_kl, rel=1e-9, abs=1e-12)
    # and the observer's own threshold is the cut of least KL on its full histogram
    full_cuts, full_div = kl_divergences(counts[:used])
    t = obs.threshold()
    chosen = round(t / obs.histogram.bin_width)
    assert full_div[list(full_cuts).index(chosen)] == pytest.approx(full_div.min(), rel=1e-9, abs=1e-12)


def test_entropy_clips_outliers_and_not_a_gaussian_bulk() -> None:
    obs = EntropyObserver(QuantRange())
    x = _distribution("outliers", (50000,), 2)
    obs.observe(x)
    assert obs.threshold() < 0.5 * float(x.abs().max())  # spikes are clipped
    g = EntropyObserver(QuantRange())
    g.observe(torch.randn(50000))
    assert 2.0 < g.threshold() <= 5.0  # a Gaussian keeps at least 2 sigma


def _direct_mse(values: np.ndarray, lo: float, hi: float, qrange: QuantRange) -> list[float]:
    """For each candidate hi * (1 - k / 100), quantise every value and sum the squared errors."""
    errors = []
    for k in range(80):
        f = 1 - k / 100
        clo, chi = torch.tensor(lo * f, dtype=torch.float64), torch.tensor(hi * f, dtype=torch.float64)
        scale, zp = calculate_qparams(clo.float(), chi.float(), qrange)
        s, z = float(scale), int(zp)
        err = 0.0
        for v in values:
            q = min(max(round(float(np.float32(v) / np.float32(s))) + z, qrange.qmin), qrange.qmax)
            err += (float(v) - (q - z) * s) ** 2
        errors.append(err)
    return errors


@pytest.mark.parametrize("qrange", [QuantRange(8, True), QuantRange(4, True), QuantRange(4, False)], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_per_channel_mse_is_the_grid_minimum(qrange: QuantRange, kind: str) -> None:
    w = _distribution(kind, (3, 157), 4)
    obs = MSEObserver(qrange, axis=0)
    obs.observe(w)
    lo, hi = obs.clip_range()
    for c in range(w.shape[0]):
        row = w[c].double().numpy()
        rlo, rhi = float(row.min()), float(row.max())
        if qrange.symmetric:
            amax = max(-rlo, rhi)
            rlo, rhi = -amax, amax
        errors = _direct_mse(row, rlo, rhi, qrange)
        scale, zp = calculate_qparams(lo[c : c + 1], hi[c : c + 1], qrange)
        q = quantize_tensor(w[c : c + 1], scale[:, None], zp[:, None], qrange)
        deq = dequantize_tensor(q, scale[:, None], zp[:, None]).double()
        ours = float(((deq - w[c].double()) ** 2).sum())
        assert ours == pytest.approx(min(errors), rel=1e-4)
    if kind == "outliers":
        assert torch.all(hi <= w.abs().amax(dim=1))


@pytest.mark.parametrize("kind", KINDS)
def test_per_tensor_mse_is_near_the_raw_grid_minimum(kind: str) -> None:
    x = _distribution(kind, (3000,), 9)
    obs = MSEObserver(QuantRange())
    obs.observe(x[:1000])
    obs.observe(x[1000:])
    _, hi = obs.clip_range()
    values = x.double().numpy()
    amax = float(np.abs(values).max())
    errors = _direct_mse(values, -amax, amax, QuantRange())
    scale, zp = calculate_qparams(-hi, hi, QuantRange())
    deq = dequantize_tensor(quantize_tensor(x, scale, zp, QuantRange()), scale, zp)
    ours = float(((deq.double() - x.double()) ** 2).sum())
    assert ours <= min(errors) * 1.03  # the histogram's sub-bin points approximate the raw values
    assert float(hi) in [pytest.approx(float(c), rel=1e-6) for c in mse_candidates(torch.tensor(amax))]


def test_errors_name_the_problem() -> None:
    with pytest.raises(TesselError, match="num_bits"):
        QuantRange(3)
    with pytest.raises(TesselError, match="code_bits 7 applies to symmetric int8"):
        QuantRange(4, True, code_bits=7)
    with pytest.raises(TesselError, match="code_bits 7 applies to symmetric int8"):
        QuantRange(8, False, code_bits=7)
    with pytest.raises(TesselError, match="code_bits 6"):
        QuantRange(8, True, code_bits=6)
    assert (QuantRange(8, True, code_bits=7).qmin, QuantRange(8, True, code_bits=7).qmax) == (-63, 63)
    with pytest.raises(TesselError, match="unknown observer"):
        make_observer("kmeans", QuantRange())
    with pytest.raises(TesselError, match="per-tensor and symmetric"):
        EntropyObserver(QuantRange(8, False))
    with pytest.raises(TesselError, match="seen no values"):
        MinMaxObserver(QuantRange()).qparams()
    with pytest.raises(TesselError, match="inf or NaN"):
        PercentileObserver(QuantRange()).observe(torch.tensor([1.0, float("nan")]))


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=1, max_size=64),
    name=st.sampled_from(["minmax", "moving-average", "percentile", "entropy", "mse"]),
)
def test_any_finite_input_gives_a_positive_scale(values: list[float], name: str) -> None:
    obs = make_observer(name, QuantRange())
    obs.observe(torch.tensor(values))
    scale, zp = obs.qparams()
    assert torch.all(scale > 0) and torch.all(torch.isfinite(scale)) and torch.all(zp == 0)
