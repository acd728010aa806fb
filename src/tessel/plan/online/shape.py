"""What the online latency model reads from a workload: mean and p90 prompt, mean output, and how
much request stays vary (the squared coefficient of variation of the output length).

Lengths are drawn as the simulator draws them (`tessel.sim.request_trace`): samples as given, a
mean alone for every request, a mean with p99 / max lognormal with that mean (sigma from
`lognormal_sigma`), clipped to max. Any quantile of the clipped lognormal is min(max, its quantile); its
cs2 is the unclipped exp(sigma^2) - 1 (clipping only lowers it: a little pessimistic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from tessel.plan.files.workload import TokenDistribution, Workload, lognormal_sigma

SLO_QUANTILE = 0.9  # the SLOs are p90s
OUTPUT_POINTS = 40  # quantiles of the output length the TPOT spread is averaged over


@dataclass(frozen=True, slots=True)
class OnlineShape:
    prompt_mean_tokens: float
    prompt_p90_tokens: float
    output_mean_tokens: float
    output_cs2: float  # squared coefficient of variation of the output length
    output_points: tuple[float, ...] = ()  # output lengths at evenly spaced quantiles (the TPOT spread)
    prompt_cs2: float = 0.0  # squared coefficient of variation of the prompt length

    @classmethod
    def of(cls, workload: Workload) -> OnlineShape:
        prompt, output = workload.prompt_tokens, workload.output_tokens
        points = tuple(length_quantile(output, (i + 0.5) / OUTPUT_POINTS) for i in range(OUTPUT_POINTS))
        return cls(
            prompt.mean_tokens,
            length_quantile(prompt, SLO_QUANTILE),
            output.mean_tokens,
            length_cs2(output),
            points,
            length_cs2(prompt),
        )


def _sigma(tokens: TokenDistribution) -> float | None:
    """The lognormal sigma the simulator draws with, None for a fixed length."""
    tail = tokens.p99 if tokens.p99 is not None else tokens.max
    if tail is None or tail <= tokens.mean:
        return None
    return lognormal_sigma(float(tokens.mean), tail)


def length_quantile(tokens: TokenDistribution, quantile: float) -> float:
    if tokens.samples is not None:
        ordered = sorted(tokens.samples)
        return float(ordered[min(len(ordered) - 1, math.ceil(quantile * len(ordered)) - 1)])
    sigma = _sigma(tokens)
    if sigma is None:
        return float(tokens.mean)
    z = NormalDist().inv_cdf(quantile)
    mu = math.log(tokens.mean) - sigma**2 / 2
    return min(float(tokens.max_tokens if tokens.max is not None else math.inf), math.exp(mu + z * sigma))


def length_cs2(tokens: TokenDistribution) -> float:
    if tokens.samples is not None:
        mean = tokens.mean_tokens
        return sum((s - mean) ** 2 for s in tokens.samples) / len(tokens.samples) / mean**2
    sigma = _sigma(tokens)
    return 0.0 if sigma is None else math.expm1(sigma**2)
