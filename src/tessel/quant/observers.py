"""Observers: watch tensors, then give the clip range and (scale, zero_point) to quantise them with.

The scale and zero point of a clip range, and the rounding, are `tessel.models.quantized.qparams`
(shared with the runtime, which rounds a plan's int8 / int4 layers at load); their results match
`torch.ao.quantization`'s observers bit for bit (tests hold them to it).

How the range is found:

- `minmax`: the running min / max (per tensor, or per channel along `axis`).
- `moving-average`: min / max averaged over batches, `m <- m + c * (m_batch - m)` (torch.ao's rule).
- `percentile`: the p-th percentile of |x| from a histogram (per tensor, symmetric).
- `entropy`: TensorRT's KL calibration: a 2048-bin |x| histogram; for each candidate cut i >= 128
  bins, P = the first i bins with the outliers added to the last, Q = those i bins merged into 128
  levels and spread back evenly over the bins that were non-zero; the cut with the least KL(P || Q)
  wins (the largest such cut on ties), threshold = i * bin width (per tensor, symmetric).
- `mse`: a grid search of the clip range, `hi * (1 - k / 100)` for k = 0..79, minimising the squared
  quantisation error: on the observed values per channel, on the histogram per tensor.

The histogram spans [0, base * 2**k]: when a larger |x| arrives, k grows and bins are merged in
pairs, which is exact, so the histogram never depends on batch order.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np
import torch

from tessel.errors import TesselError
from tessel.models.quantized.qparams import QuantRange, calculate_qparams, dequantize_tensor, quantize_tensor
from tessel.models.quantized.schemes import WeightQParams

HISTOGRAM_BINS = 2048  # TensorRT's entropy calibration
KL_LEVELS = 128  # quantised bins of the KL search (int8: 2**7 levels of |x|)
MSE_GRID = 100  # the clip search steps 1 / MSE_GRID of the range ...
MSE_MAX_SHRINK = 0.8  # ... down to 20% of it (llm-compressor's MSE observer defaults)
MSE_SUBSAMPLES = 8  # points per histogram bin when the MSE is measured on a histogram
DEFAULT_PERCENTILE = 99.99
DEFAULT_AVERAGING = 0.01  # torch.ao MovingAverageMinMaxObserver's averaging_constant


def _channel_rows(x: torch.Tensor, axis: int) -> torch.Tensor:
    """x with `axis` first and everything else flattened: [channels, values] float32."""
    return torch.flatten(x.detach().movedim(axis, 0).float(), start_dim=1)


class Observer(ABC):
    """Watch tensors with `observe(x)`; `clip_range()` -> (lo, hi); `qparams()` -> (scale, zero_point).

    axis=None: one range for the whole tensor; axis=a: one per index along a (per channel; for
    activations [tokens, features], axis=0 is per token).
    """

    name: str = ""

    def __init__(self, qrange: QuantRange, axis: int | None = None) -> None:
        self.qrange = qrange
        self.axis = axis
        self.num_observed = 0

    def observe(self, x: torch.Tensor) -> None:
        if x.numel() == 0:
            return
        if not x.is_floating_point():
            raise TesselError(f"{self.name} observer wants a float tensor; got {x.dtype}")
        self._observe(x.detach())
        self.num_observed += 1

    @abstractmethod
    def _observe(self, x: torch.Tensor) -> None: ...

    @abstractmethod
    def clip_range(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.num_observed == 0:
            raise TesselError(f"the {self.name} observer has seen no values; calibrate first")
        lo, hi = self.clip_range()
        return calculate_qparams(lo, hi, self.qrange)

    def _aminmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.axis is None:
            return torch.aminmax(x.float())
        return torch.aminmax(_channel_rows(x, self.axis), dim=1)


class MinMaxObserver(Observer):
    name = "minmax"

    def _observe(self, x: torch.Tensor) -> None:
        lo, hi = self._aminmax(x)
        if self.num_observed:
            lo, hi = torch.min(lo, self.lo), torch.max(hi, self.hi)
        self.lo, self.hi = lo, hi

    def clip_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lo, self.hi


class MovingAverageMinMaxObserver(MinMaxObserver):
    name = "moving-average"

    def __init__(
        self, qrange: QuantRange, axis: int | None = None, averaging_constant: float = DEFAULT_AVERAGING
    ) -> None:
        super().__init__(qrange, axis)
        if not 0 < averaging_constant <= 1:
            raise TesselError(f"averaging_constant must be in (0, 1]; got {averaging_constant}")
        self.c = averaging_constant

    def _observe(self, x: torch.Tensor) -> None:
        lo, hi = self._aminmax(x)
        if self.num_observed:
            lo = self.lo + self.c * (lo - self.lo)
            hi = self.hi + self.c * (hi - self.hi)
        self.lo, self.hi = lo, hi


class AbsHistogram:
    """Counts of |x| in HISTOGRAM_BINS equal bins over [0, width * HISTOGRAM_BINS], float64."""

    def __init__(self) -> None:
        self.counts = np.zeros(HISTOGRAM_BINS, dtype=np.float64)
        self.bin_width = 0.0
        self.amax = 0.0

    @property
    def upper(self) -> float:
        return self.bin_width * HISTOGRAM_BINS

    def add(self, x: torch.Tensor) -> None:
        values = x.detach().abs().flatten().double()
        amax = float(values.max())
        if not math.isfinite(amax):
            raise TesselError("the observed tensor holds inf or NaN; cannot calibrate on it")
        self.amax = max(self.amax, amax)
        if self.bin_width == 0.0:
            if amax == 0.0:
                self.counts[0] += values.numel()
                return
            self.bin_width = amax / HISTOGRAM_BINS
        while amax > self.upper:  # double the range: merge bins in pairs (exact)
            self.counts = np.concatenate(
                [self.counts.reshape(-1, 2).sum(axis=1), np.zeros(HISTOGRAM_BINS // 2)]
            )
            self.bin_width *= 2
        index = torch.clamp((values / self.bin_width).floor().long(), 0, HISTOGRAM_BINS - 1)
        self.counts += torch.bincount(index, minlength=HISTOGRAM_BINS).double().numpy()

    def edges(self) -> np.ndarray:
        return np.arange(HISTOGRAM_BINS + 1, dtype=np.float64) * self.bin_width


class _HistogramObserver(Observer):
    """Per-tensor, symmetric: a range (-t, t) found on the |x| histogram."""

    def __init__(self, qrange: QuantRange, axis: int | None = None) -> None:
        if axis is not None or not qrange.symmetric:
            raise TesselError(f"the {self.name} observer is per-tensor and symmetric only")
        super().__init__(qrange, axis)
        self.histogram = AbsHistogram()

    def _observe(self, x: torch.Tensor) -> None:
        self.histogram.add(x)

    def clip_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor(self.threshold(), dtype=torch.float32)
        return -t, t

    def threshold(self) -> float:
        if self.histogram.bin_width == 0.0:
            return 0.0
        return min(self._threshold(), self.histogram.amax)

    @abstractmethod
    def _threshold(self) -> float: ...


class PercentileObserver(_HistogramObserver):
    name = "percentile"

    def __init__(
        self, qrange: QuantRange, axis: int | None = None, percentile: float = DEFAULT_PERCENTILE
    ) -> None:
        super().__init__(qrange, axis)
        if not 0 < percentile <= 100:
            raise TesselError(f"percentile must be in (0, 100]; got {percentile}")
        self.percentile = percentile

    def _threshold(self) -> float:
        cumulative = np.cumsum(self.histogram.counts)
        target = cumulative[-1] * self.percentile / 100
        index = int(np.searchsorted(cumulative, target, side="left"))
        return (min(index, HISTOGRAM_BINS - 1) + 1) * self.histogram.bin_width


def kl_divergences(counts: np.ndarray, levels: int = KL_LEVELS) -> tuple[np.ndarray, np.ndarray]:
    """KL(P || Q) of every candidate cut i in [levels, len(counts)] (TensorRT entropy calibration)."""
    n = len(counts)
    cuts = np.arange(levels, n + 1)
    divergences = np.empty(len(cuts))
    total = counts.sum()
    tail = total - np.cumsum(counts)  # outliers beyond bin i-1: tail[i-1]
    for j, i in enumerate(cuts):
        bins = counts[:i]
        level = (np.arange(i) * levels) // i  # np.digitize(range(i), linspace(0, i, levels+1)) - 1
        nonzero = bins > 0
        merged = np.bincount(level, weights=bins, minlength=levels)
        spread = np.bincount(level, weights=nonzero.astype(np.float64), minlength=levels)
        q = np.where(nonzero, merged[level] / np.maximum(spread[level], 1), 0.0)
        p = bins.copy()
        p[-1] += tail[i - 1]
        divergences[j] = _kl(p, q)
    return cuts, divergences


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    """scipy.stats.entropy(p, q): sum p log(p / q) over p > 0 after normalising; inf where q = 0 < p."""
    p = p / p.sum()
    qs = q.sum()
    if qs == 0:
        return math.inf
    q = q / qs
    mask = p > 0
    if np.any(q[mask] == 0):
        return math.inf
    return float(np.sum(p[mask] * np.log(p[mask] / q[mask])))


class EntropyObserver(_HistogramObserver):
    name = "entropy"

    def _threshold(self) -> float:
        counts = self.histogram.counts
        used = int(np.max(np.nonzero(counts)[0])) + 1  # bins past the last non-zero one change nothing
        if used <= KL_LEVELS:
            return used * self.histogram.bin_width
        cuts, divergences = kl_divergences(counts[:used])
        best = len(divergences) - 1 - int(np.argmin(divergences[::-1]))
        return int(cuts[best]) * self.histogram.bin_width


def mse_candidates(hi: torch.Tensor) -> torch.Tensor:
    """Clip candidates hi * (1 - k / MSE_GRID), k = 0 .. MSE_MAX_SHRINK * MSE_GRID - 1: [K, *hi.shape]."""
    steps = int(MSE_MAX_SHRINK * MSE_GRID)
    shrink = 1 - torch.arange(steps, dtype=torch.float64) / MSE_GRID
    return shrink.view(-1, *([1] * hi.dim())) * hi.double().unsqueeze(0)


def _mse_search(values: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, qrange: QuantRange, weights=None):
    """For rows of `values` [C, V] and ranges [C]: the shrink index with the least sum w * (x - Q(x))^2."""
    los, his = mse_candidates(lo), mse_candidates(hi)  # [K, C]
    errors = []
    for k in range(los.shape[0]):
        scale, zero_point = calculate_qparams(los[k].float(), his[k].float(), qrange)
        scale, zero_point = scale[:, None], zero_point[:, None]
        deq = dequantize_tensor(quantize_tensor(values, scale, zero_point, qrange), scale, zero_point)
        err = (values.double() - deq.double()) ** 2
        errors.append((err * weights if weights is not None else err).sum(dim=1))
    best = torch.stack(errors).argmin(dim=0)  # first (largest range) on ties
    return los.gather(0, best[None]).squeeze(0).float(), his.gather(0, best[None]).squeeze(0).float()


class MSEObserver(Observer):
    """Clip range by grid search: per channel on the observed weight, per tensor on the histogram."""

    name = "mse"

    def __init__(self, qrange: QuantRange, axis: int | None = None) -> None:
        super().__init__(qrange, axis)
        if axis is None and not qrange.symmetric:
            raise TesselError("the per-tensor mse observer is symmetric only")
        self.histogram = AbsHistogram()

    def _observe(self, x: torch.Tensor) -> None:
        if self.axis is None:
            self.histogram.add(x)
            return
        if self.num_observed:
            raise TesselError("the per-channel mse observer takes one tensor (a weight)")
        self.values = _channel_rows(x, self.axis)

    def clip_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.axis is not None:
            lo, hi = torch.aminmax(self.values, dim=1)
            if self.qrange.symmetric:
                amax = torch.max(-lo, hi)
                lo, hi = -amax, amax
            return _mse_search(self.values, lo, hi, self.qrange)
        h = self.histogram
        if h.bin_width == 0.0:
            zero = torch.zeros(1)
            return zero, zero
        sub = (np.arange(HISTOGRAM_BINS * MSE_SUBSAMPLES) + 0.5) * (h.bin_width / MSE_SUBSAMPLES)
        weights = np.repeat(h.counts / MSE_SUBSAMPLES, MSE_SUBSAMPLES)
        keep = weights > 0
        values = torch.from_numpy(sub[keep]).float()[None]
        amax = torch.tensor([h.amax], dtype=torch.float32)
        lo, hi = _mse_search(values, -amax, amax, self.qrange, torch.from_numpy(weights[keep])[None])
        return lo.reshape(()), hi.reshape(())


OBSERVERS: dict[str, type[Observer]] = {
    "minmax": MinMaxObserver,
    "moving-average": MovingAverageMinMaxObserver,
    "percentile": PercentileObserver,
    "entropy": EntropyObserver,
    "mse": MSEObserver,
}


WEIGHT_OBSERVERS = ("minmax", "mse")  # the per-channel observers a weight's scales may come from


def make_observer(name: str, qrange: QuantRange, axis: int | None = None) -> Observer:
    if name not in OBSERVERS:
        raise TesselError(f"unknown observer {name!r}; choose one of {', '.join(OBSERVERS)}")
    return OBSERVERS[name](qrange, axis)


def weight_qparams(observer: str) -> WeightQParams:
    """`quantize_weight`'s (scale, zero_point) of each row of a weight by the weight observer `observer`."""
    if observer not in WEIGHT_OBSERVERS:
        raise TesselError(f"weight observer must be one of {', '.join(WEIGHT_OBSERVERS)}; got {observer!r}")

    def qparams(rows: torch.Tensor, qrange: QuantRange) -> tuple[torch.Tensor, torch.Tensor]:
        obs = make_observer(observer, qrange, axis=0)
        obs.observe(rows)
        return obs.qparams()

    return qparams
