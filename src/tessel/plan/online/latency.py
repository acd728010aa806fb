"""Predicted p90 TTFT and TPOT of one pipeline at an arrival rate, and the highest rate meeting SLOs.

The pipeline runs as the simulator's `plan` regime runs it: k micro-batch slots of b requests each
(c = k b seats), every slot's micro-batch circulating through the S stages; T^dec_j and T^pre_j are
stage j's times for a micro-batch's decode step and for the prefill of b mean prompts (the
planner's `evaluate`, sends included), so one prompt costs p_j = T^pre_j / b on stage j.

TPOT: a slot's micro-batch comes back every cycle C, one token per request each time. New prompts
ride in the micro-batches as chunks (chunked prefill). The cycle is held by the bottleneck, where k
micro-batches queue, or by the length of the pipeline, where each micro-batch carries its slot's
share lambda / k of the prompts:

    C = max( k max_j T^dec_j / (1 - lambda P),  (sum_j T^dec_j + R) / (1 - lambda P / k) ),  P = sum_j p_j
    R = lambda (k - 1) / k x sum_j p_j^2 (1 + cs2_prompt) / 2

In the first form a prompt holds the cycle for its whole pass, sum_j p_j, not only for its time on
the bottleneck: the stages take the micro-batches in one order, so with the stages near balance
(little slack) the micro-batch carrying the prompt is late at every stage after the first and the
others wait behind it. In the second form a micro-batch reaching stage j while another slot's prompt
is in service there waits its residual: stage j serves those prompts a share lambda (k-1)/k p_j of
the time, their mean residual is E[p_j^2] / (2 E[p_j]) (M/G/1's residual life), so R per cycle.
(Without R the mean TPOT read 10-15% below the simulator's on 4 A100 stages with 2 micro-batches.)
(Charging only lambda p_j on each stage, the fluid reading, predicted TPOTs up to 20% below the
simulator's near capacity on a 6-stage V100 + T4 pipeline.) C is the mean TPOT; its p90 over
requests counts how unevenly the prompts fall on short and long answers (`tpot_quantile_s`). C is
inf when a denominator reaches 0. Stage times are at full occupancy: a conservative reading at light
load, where the micro-batches are smaller.

TTFT: the wait for a seat (`queueing.wait_quantile_s`: M/G/c, c seats, each held for the stay
S = TTFT + (n_out - 1) C, cs2 of the output length) plus, once seated, a cycle for the slot's
micro-batch to come round and the p90 prompt's pass through every stage:

    TTFT_p90 = W_p90 + C + sum_j p_j x prompt_p90 / prompt_mean

The two p90s are added (the p90 of a sum is at most that): again on the safe side. Monotone in
lambda, so the highest rate meeting both SLOs is found by bisection (`goodput_req_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessel.plan.online.queueing import wait_quantile_s
from tessel.plan.online.shape import SLO_QUANTILE, OnlineShape

RATE_RTOL = 1e-4  # bisection stops when the bracket is this narrow (relative)
MAX_BISECTIONS = 60
TPOT_BISECTIONS = 40


@dataclass(frozen=True, slots=True)
class PipelineTimes:
    """One pipeline at one concurrency: per-stage times (s) and its seats."""

    decode_s: tuple[float, ...]  # T^dec_j, one decode step of a micro-batch of b
    prefill_s: tuple[float, ...]  # T^pre_j, the prefill of b mean prompts
    micro_batches: int  # k slots in flight
    micro_batch_size: int  # b requests per slot

    @property
    def seats(self) -> int:
        return self.micro_batches * self.micro_batch_size

    def prompt_s(self) -> tuple[float, ...]:
        """p_j: one mean prompt's prefill on each stage."""
        return tuple(t / self.micro_batch_size for t in self.prefill_s)


@dataclass(frozen=True, slots=True)
class LatencyPrediction:
    rate_req_s: float
    ttft_p90_s: float
    tpot_p90_s: float

    def meets(self, ttft_slo_s: float, tpot_slo_s: float) -> bool:
        return self.ttft_p90_s <= ttft_slo_s and self.tpot_p90_s <= tpot_slo_s


def cycle_s(times: PipelineTimes, shape: OnlineShape, rate_req_s: float) -> tuple[float, float]:
    """(C, the rate of the prompts that hold it): how often a slot's micro-batch comes back, the mean
    TPOT (inf when prompts saturate the pipeline)."""
    prompt = times.prompt_s()
    prompts_s = sum(prompt)
    k = times.micro_batches
    held = 1 - rate_req_s * prompts_s  # the share of time the bottleneck's cycle is not held by prompts
    own = 1 - rate_req_s * prompts_s / k  # the same for one slot's micro-batch and its own prompts
    if held <= 0 or own <= 0:
        return math.inf, rate_req_s
    foreign = rate_req_s * (k - 1) / k  # other slots' prompts, met in service: their residual
    residual = foreign * sum(p * p for p in prompt) * (1 + shape.prompt_cs2) / 2
    tight, loose = k * max(times.decode_s) / held, (sum(times.decode_s) + residual) / own
    return (tight, rate_req_s) if tight >= loose else (loose, rate_req_s / k)


def _tpot_spreads(times: PipelineTimes, shape: OnlineShape, rate_req_s: float) -> tuple[float, list[float]]:
    """(C, the TPOT standard deviation of a request at each of the output points)."""
    cycle, rate = cycle_s(times, shape, rate_req_s)
    if not math.isfinite(cycle) or rate <= 0 or not shape.output_points:
        return cycle, []
    square = sum(times.prompt_s()) ** 2 * (1 + shape.prompt_cs2)
    return cycle, [math.sqrt(rate * cycle * square / max(n - 1, 1.0)) for n in shape.output_points]


def tpot_share_above(times: PipelineTimes, shape: OnlineShape, rate_req_s: float, tpot_s: float) -> float:
    """The share of requests whose TPOT exceeds `tpot_s` (`tpot_quantile_s`'s model)."""
    cycle, spreads = _tpot_spreads(times, shape, rate_req_s)
    if not spreads:
        return 1.0 if cycle > tpot_s else 0.0
    tails = (0.5 * math.erfc((tpot_s - cycle) / (sd * math.sqrt(2))) if sd > 0 else float(cycle > tpot_s)
             for sd in spreads)  # fmt: skip
    return sum(tails) / len(spreads)


def tpot_quantile_s(times: PipelineTimes, shape: OnlineShape, rate_req_s: float, quantile: float) -> float:
    """The `quantile` over requests of their TPOT. A request of n tokens sees N ~ Poisson(r (n - 1) C)
    prompts hold its cycle (r the rate of those that do, `cycle_s`), each for P = sum_j p_j x its
    length over the mean: its TPOT is C + (sum of the N holds - r (n - 1) C E[P]) / (n - 1), mean C,
    variance r C E[P^2] / (n - 1), E[P^2] = E[P]^2 (1 + the prompt length's cs2). Short answers spread
    most; the quantile is taken over the output lengths (`OnlineShape.output_points`), each normal."""
    cycle, spreads = _tpot_spreads(times, shape, rate_req_s)
    if not spreads:
        return cycle
    low, high = cycle, cycle + 4 * max(spreads)
    for _ in range(TPOT_BISECTIONS):
        middle = (low + high) / 2
        low, high = (
            (middle, high)
            if tpot_share_above(times, shape, rate_req_s, middle) > 1 - quantile
            else (low, middle)
        )
    return high


def ttft_p90_s(times: PipelineTimes, shape: OnlineShape, rate_req_s: float, cycle: float) -> float:
    """Wait for a seat (its p90) + a cycle + the p90 prompt's pass (module docstring)."""
    seated = cycle + sum(times.prompt_s()) * shape.prompt_p90_tokens / shape.prompt_mean_tokens
    stay = cycle + sum(times.prompt_s()) + max(shape.output_mean_tokens - 1, 0.0) * cycle
    return wait_quantile_s(times.seats, rate_req_s, stay, shape.output_cs2, SLO_QUANTILE) + seated


def predict_p90(times: PipelineTimes, shape: OnlineShape, rate_req_s: float) -> LatencyPrediction:
    """p90 TTFT and TPOT (s) at `rate_req_s` (the module docstring's model; inf: it cannot keep up)."""
    cycle = cycle_s(times, shape, rate_req_s)[0]
    if not math.isfinite(cycle):
        return LatencyPrediction(rate_req_s, math.inf, math.inf)
    tpot = tpot_quantile_s(times, shape, rate_req_s, SLO_QUANTILE)
    return LatencyPrediction(rate_req_s, ttft_p90_s(times, shape, rate_req_s, cycle), tpot)


def meets_slo(
    times: PipelineTimes, shape: OnlineShape, rate_req_s: float, ttft_slo_s: float, tpot_slo_s: float
) -> bool:
    """Whether both predicted p90s are within the SLOs (`predict_p90(...).meets`, without the quantile
    search: at most a tenth of the requests above the TPOT SLO)."""
    cycle = cycle_s(times, shape, rate_req_s)[0]
    if not math.isfinite(cycle) or cycle > tpot_slo_s:
        return False
    if tpot_share_above(times, shape, rate_req_s, tpot_slo_s) > 1 - SLO_QUANTILE:
        return False
    return ttft_p90_s(times, shape, rate_req_s, cycle) <= ttft_slo_s


def capacity_req_s(times: PipelineTimes, shape: OnlineShape) -> float:
    """A rate no run of these seats sustains: c / (the stay at light load)."""
    prediction = predict_p90(times, shape, 0.0)
    stay = prediction.tpot_p90_s * max(shape.output_mean_tokens - 1, 0.0) + prediction.tpot_p90_s
    stay += sum(times.prompt_s())
    return times.seats / stay


def goodput_req_s(times: PipelineTimes, shape: OnlineShape, ttft_slo_s: float, tpot_slo_s: float) -> float:
    """The highest rate whose predicted p90s meet both SLOs (0: not even a trickle does)."""
    if not meets_slo(times, shape, 0.0, ttft_slo_s, tpot_slo_s):
        return 0.0
    low, high = 0.0, capacity_req_s(times, shape)
    for _ in range(MAX_BISECTIONS):
        if high - low <= RATE_RTOL * high:
            break
        middle = (low + high) / 2
        if meets_slo(times, shape, middle, ttft_slo_s, tpot_slo_s):
            low = middle
        else:
            high = middle
    return low
