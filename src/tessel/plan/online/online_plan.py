"""`tessel plan --objective goodput`: the plan that serves the most requests/s within the SLOs.

For every micro-batch size b of `MICRO_BATCH_SIZES` (one b for the whole plan: the plan file and the
simulator's `plan` regime carry one), pipelines are chosen greedily on the devices not yet taken:
every candidate placement (`candidates`) is priced at its best concurrency k (`pipelines.price`, the
goodput of `latency`), the one with the most goodput is kept, its devices are taken, and again until
no candidate meets the SLOs; the first pick is each of the `FIRST_TRIES` best in turn; then the best
set of disjoint pipelines among all those priced (`packing`). The baseline's pipelines are a plan
too, so the answer is never below the baseline. Disjoint pipelines'
goodputs add up: routing each its goodput's share of the requests, each meets the p90s on its share,
so the merged stream does too. One pipeline, several same-type pipelines (Helix's separate
pipelines), mixed ones: whichever serves most. The baseline (`baseline.separate_same_type`) is
priced by the same model.

Flow plans whose paths share a GPU are not candidates: the waits where paths meet are outside this
model. Nothing is offloaded (the instances have no host memory): a streamed layer costs its transfer
on every decode step, far beyond any TPOT SLO on the bundled clusters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tessel.errors import TesselError
from tessel.plan.build import build_instance
from tessel.plan.files.workload import Workload
from tessel.plan.instance import PlanningInstance, gpu_memory_only
from tessel.plan.online.baseline import SeparateSameType, separate_same_type
from tessel.plan.online.candidates import CandidatePlacements
from tessel.plan.online.packing import best_packing
from tessel.plan.online.pipelines import LightLoad, Placement, PricedPipeline, light_load, price
from tessel.plan.online.shape import OnlineShape

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
REFERENCE_B = 8  # candidates are placed at this micro-batch size, then priced at every one
FIRST_TRIES = 4  # the best first pipelines each tried before the greedy rest
CANDIDATE_SHARE = 0.8  # of the time limit for placing candidates; pricing takes the rest


@dataclass(frozen=True, slots=True)
class OnlineSettings:
    time_limit_s: float = 60.0
    micro_batch_sizes: tuple[int, ...] = MICRO_BATCH_SIZES
    solver: str = "milp"  # places the mixed candidate groups


@dataclass(frozen=True, slots=True)
class OnlinePlan:
    pipelines: tuple[PricedPipeline, ...]  # disjoint, in the order chosen
    micro_batch_size: int
    slo: tuple[float, float]  # p90 TTFT, p90 TPOT (s)
    shape: OnlineShape
    baseline: SeparateSameType | None  # None: no same-type pipeline meets the SLOs
    goodput_by_b: dict[int, float]  # the best plan's goodput at each micro-batch size tried
    placements_priced: int
    time_s: float
    instances: dict[int, PlanningInstance]  # the cluster at each b (one micro-batch, GPU memory only)

    @property
    def goodput_req_s(self) -> float:
        return sum(p.goodput_req_s for p in self.pipelines)

    @property
    def weights(self) -> tuple[float, ...]:
        """Routing: each pipeline's goodput over the plan's."""
        total = self.goodput_req_s
        return tuple(p.goodput_req_s / total for p in self.pipelines)

    @property
    def ratio(self) -> float | None:
        """Goodput over the baseline's (None: the baseline meets the SLOs at no rate)."""
        if self.baseline is None or self.baseline.goodput_req_s <= 0:
            return None
        return self.goodput_req_s / self.baseline.goodput_req_s

    @property
    def kind(self) -> str:
        return "single" if len(self.pipelines) == 1 else "replicas"


def online_workload(workload: Workload) -> tuple[float, float]:
    """The SLOs of an online workload (p90 TTFT, p90 TPOT); refused without them or an arrival rate."""
    if workload.slo is None:
        raise TesselError(
            f"workload {workload.name} has no `slo: {{ttft_p90_s, tpot_p90_s}}`: --objective goodput plans "
            "the highest rate that meets them (see the bundled chat-slo workload)"
        )
    if workload.arrival_rate_per_s is None:
        raise TesselError(f"workload {workload.name} is an offline batch: --objective goodput needs arrivals")
    return workload.slo.ttft_p90_s, workload.slo.tpot_p90_s


def at_micro_batch(workload: Workload, b: int) -> Workload:
    """The workload as one micro-batch of b requests (the instance's pass costs are priced at b)."""
    update = {"batch_size": b, "arrival_rate_per_s": None, "latency_estimate_s": None, "max_micro_batch": 1}
    return workload.model_copy(update=update)


def plan_online(model, cluster, workload: Workload, settings: OnlineSettings, **options) -> OnlinePlan:  # noqa: ANN001
    """The plan with the most goodput (module docstring); `options` go to `build_instance`."""
    started = time.perf_counter()
    slo = online_workload(workload)
    shape = OnlineShape.of(workload)
    instances = {
        b: gpu_memory_only(build_instance(model, cluster, at_micro_batch(workload, b), **options))
        for b in settings.micro_batch_sizes
    }
    reference = REFERENCE_B if REFERENCE_B in instances else settings.micro_batch_sizes[-1]
    deadline = started + CANDIDATE_SHARE * settings.time_limit_s
    candidates = CandidatePlacements(instances[reference], deadline, slo[1], settings.solver)
    best, by_b, priced = None, {}, 0
    for b, instance in instances.items():
        chosen, count = _search(candidates, instance, b, shape, slo)
        priced += count
        by_b[b] = sum(p.goodput_req_s for p in chosen)
        if chosen and (best is None or by_b[b] > sum(p.goodput_req_s for p in best[1])):
            best = (b, chosen)
    baseline = separate_same_type(instances, shape, slo)
    if baseline is not None and (
        best is None or baseline.goodput_req_s > sum(p.goodput_req_s for p in best[1])
    ):
        best = (baseline.micro_batch_size, list(baseline.pipelines))  # never below the baseline
    if best is None:
        raise TesselError(unreachable_message(candidates, instances, shape, slo))
    return OnlinePlan(
        tuple(best[1]), best[0], slo, shape, baseline, by_b, priced, time.perf_counter() - started, instances
    )


def _search(candidates: CandidatePlacements, instance: PlanningInstance, b: int, shape, slo):  # noqa: ANN001
    """Each of the `FIRST_TRIES` best first pipelines, then greedily the rest; then the best set of
    disjoint pipelines among every one priced on the way (`packing.best_packing`), which generated
    candidates on the devices each greedy step left. (pipelines, placements priced)."""
    everything = tuple(range(instance.n_devices))
    seen: dict[tuple, PricedPipeline] = {}
    firsts, count = _priced(candidates, instance, everything, b, shape, slo, seen)
    best: list[PricedPipeline] = []
    for first in firsts[:FIRST_TRIES]:
        taken = set(first.placement.devices)
        free = tuple(j for j in everything if j not in taken)
        rest, more = _greedy(candidates, instance, free, b, shape, slo, seen)
        count += more
        if sum(p.goodput_req_s for p in (first, *rest)) > sum(p.goodput_req_s for p in best):
            best = [first, *rest]
    packed = best_packing(list(seen.values()))
    if packed.goodput_req_s > sum(p.goodput_req_s for p in best) * (1 + 1e-12):
        best = list(packed.pipelines)
    return best, count


def _priced(candidates, instance, free: tuple[int, ...], b: int, shape, slo, seen: dict):  # noqa: ANN001, ANN202
    """The candidates on `free` that meet the SLOs at some rate, the most goodput first (each also
    kept in `seen`)."""
    placements = candidates.placements(free)
    priced = (price(p, instance, b, shape, slo) for p in placements)
    kept = [p for p in priced if p is not None and p.goodput_req_s > 0]
    for p in kept:
        seen[(p.placement.devices, p.placement.solution.stages)] = p
    return sorted(kept, key=lambda p: -p.goodput_req_s), len(placements)


def _greedy(candidates, instance, free: tuple[int, ...], b: int, shape, slo, seen: dict):  # noqa: ANN001, ANN202
    """Pipelines taken one by one, the most goodput first, on the devices still free."""
    chosen, count = [], 0
    while free:
        ranked, priced = _priced(candidates, instance, free, b, shape, slo, seen)
        count += priced
        if not ranked:
            break
        chosen.append(ranked[0])
        taken = set(ranked[0].placement.devices)
        free = tuple(j for j in free if j not in taken)
    return chosen, count


def unreachable_message(candidates: CandidatePlacements, instances, shape: OnlineShape, slo) -> str:  # noqa: ANN001
    """Which SLO no candidate meets even at the lowest rate, and what the best of them reaches."""
    reached: list[tuple[LightLoad, Placement]] = []
    everything = tuple(range(next(iter(instances.values())).n_devices))
    for b, instance in instances.items():
        for placement in candidates.placements(everything):
            light = light_load(placement, instance, b, shape)
            if light is not None:
                reached.append((light, placement))
    if not reached:
        return "no pipeline of these GPUs holds the model in GPU memory; add GPUs"
    fastest = min(reached, key=lambda r: r[0].tpot_p90_s)[0]
    quickest = min(reached, key=lambda r: r[0].ttft_p90_s)[0]
    missed = []
    if fastest.tpot_p90_s > slo[1]:
        missed.append(
            f"the p90 TPOT SLO of {slo[1] * 1e3:g} ms "
            f"(the best plan reaches {fastest.tpot_p90_s * 1e3:.1f} ms)"
        )
    if quickest.ttft_p90_s > slo[0]:
        missed.append(f"the p90 TTFT SLO of {slo[0]:g} s (the best plan reaches {quickest.ttft_p90_s:.3f} s)")
    if not missed:
        missed.append(
            f"both SLOs together (the plan with the least TPOT, {fastest.tpot_p90_s * 1e3:.1f} ms, has a p90 "
            f"TTFT of {fastest.ttft_p90_s:.3f} s)"
        )
    return (
        f"no plan meets {' and '.join(missed)}, even at the lowest arrival rate with one micro-batch in "
        "flight; relax the SLOs or add faster GPUs"
    )
