"""One pipeline under the online model: its placement priced at a micro-batch size b, the most
micro-batches its GPU memory holds, and the concurrency k with the most goodput.

A placement (devices + a contiguous unit range each) is planned once (`candidates`); here it is
evaluated on the instance of each b (stage times depend on b, not on k, since nothing is
offloaded: the instance has no host memory), k runs over `K_LADDER` up to what its memory holds,
and each k's goodput is `latency.goodput_req_s`. TPOT at rate 0 grows with k (k T^dec of the
bottleneck), so the ladder stops at the first k whose TPOT alone misses the SLO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessel.plan.files.workload import MAX_MICRO_BATCHES
from tessel.plan.instance import PlanningInstance, subset, with_micro_batches
from tessel.plan.online.latency import PipelineTimes, goodput_req_s, predict_p90
from tessel.plan.online.shape import OnlineShape
from tessel.plan.replicas.replicas import memory_micro_batches
from tessel.plan.solution import Evaluation, Solution, evaluate

# micro-batches in flight tried per pipeline: every count to 8, then about 1.25x apart
K_LADDER = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)


@dataclass(frozen=True, slots=True)
class Placement:
    devices: tuple[int, ...]  # cluster device indices, in the group's order
    solution: Solution  # stage devices local to the group
    source: str  # which candidate made it ("same-type uniform", "solve k=4", ...)


@dataclass(frozen=True, slots=True)
class PricedPipeline:
    placement: Placement
    instance: PlanningInstance  # the group at b with k micro-batches
    evaluation: Evaluation
    times: PipelineTimes
    goodput_req_s: float

    @property
    def micro_batches(self) -> int:
        return self.times.micro_batches


@dataclass(frozen=True, slots=True)
class LightLoad:
    """The least p90s a placement reaches at all (k = 1, rate -> 0): what unreachable SLOs are held to."""

    ttft_p90_s: float
    tpot_p90_s: float


def times_of(evaluation: Evaluation, k: int, b: int) -> PipelineTimes:
    decode = tuple(s.time_decode_s for s in evaluation.stages)
    prefill = tuple(s.time_prefill_s for s in evaluation.stages)
    return PipelineTimes(decode, prefill, k, b)


def most_micro_batches(one: PlanningInstance, evaluation: Evaluation) -> int:
    """What the placement's stages hold (0: not even one micro-batch)."""
    held = memory_micro_batches(one, evaluation)
    return int(min(MAX_MICRO_BATCHES, math.floor(held))) if math.isfinite(held) else MAX_MICRO_BATCHES


def price(
    placement: Placement, instance_b: PlanningInstance, b: int, shape: OnlineShape, slo: tuple[float, float]
) -> PricedPipeline | None:
    """The placement's best concurrency at micro-batch size b (None: it holds no micro-batch)."""
    one = with_micro_batches(subset(instance_b, placement.devices), 1)
    evaluation = evaluate(one, placement.solution)
    if not evaluation.feasible:
        return None
    most = most_micro_batches(one, evaluation)
    best = None
    for k in (k for k in K_LADDER if k <= most):
        times = times_of(evaluation, k, b)
        if predict_p90(times, shape, 0.0).tpot_p90_s > slo[1]:
            break
        goodput = goodput_req_s(times, shape, *slo)
        if best is None or goodput > best[1]:
            best = (k, goodput)
    if best is None:
        return None
    k, goodput = best
    sub = with_micro_batches(one, k)
    return PricedPipeline(
        placement, sub, evaluate(sub, placement.solution), times_of(evaluation, k, b), goodput
    )


def light_load(
    placement: Placement, instance_b: PlanningInstance, b: int, shape: OnlineShape
) -> LightLoad | None:
    one = with_micro_batches(subset(instance_b, placement.devices), 1)
    evaluation = evaluate(one, placement.solution)
    if not evaluation.feasible:
        return None
    prediction = predict_p90(times_of(evaluation, 1, b), shape, 0.0)
    return LightLoad(prediction.ttft_p90_s, prediction.tpot_p90_s)
