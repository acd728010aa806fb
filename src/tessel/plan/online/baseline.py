"""Helix's baseline for online serving, priced by the online model: separate pipelines of one GPU
type each, layers split evenly (vLLM's default), every group size of a type from the fewest GPUs
that hold the model to all of them (the best size per type kept), each pipeline at its best
concurrency (`pipelines.price`). The types' goodputs add up; the best micro-batch size is kept.
A type none of whose pipelines meets the SLOs adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.plan.instance import PlanningInstance, subset
from tessel.plan.online.pipelines import Placement, PricedPipeline, price
from tessel.plan.online.shape import OnlineShape
from tessel.plan.replicas.replicas import smallest_group
from tessel.plan.solvers.baselines import uniform


@dataclass(frozen=True, slots=True)
class SeparateSameType:
    pipelines: tuple[PricedPipeline, ...]
    micro_batch_size: int

    @property
    def goodput_req_s(self) -> float:
        return sum(p.goodput_req_s for p in self.pipelines)


def separate_same_type(
    instances: dict[int, PlanningInstance], shape: OnlineShape, slo: tuple[float, float]
) -> SeparateSameType | None:
    """The best b's same-type pipelines (None: none meets the SLOs at any b)."""
    best = None
    for b, instance in instances.items():
        pipelines = tuple(
            p for members in _types(instance) for p in _best_size(instance, members, b, shape, slo)
        )
        if pipelines and (best is None or sum(p.goodput_req_s for p in pipelines) > best.goodput_req_s):
            best = SeparateSameType(pipelines, b)
    return best


def _types(instance: PlanningInstance) -> list[list[int]]:
    by_type: dict[str, list[int]] = {}
    for j, device in enumerate(instance.devices):
        by_type.setdefault(device.gpu_type, []).append(j)
    for members in by_type.values():
        members.sort(key=lambda j: (instance.devices[j].node, instance.devices[j].name))
    return list(by_type.values())


def _best_size(instance, members: list[int], b: int, shape, slo) -> tuple[PricedPipeline, ...]:  # noqa: ANN001
    fewest = smallest_group(instance, members)[True]
    best: tuple[PricedPipeline, ...] = ()
    for size in range(fewest or len(members) + 1, len(members) + 1):
        groups = [tuple(members[i : i + size]) for i in range(0, len(members) - size + 1, size)]
        priced = tuple(p for g in groups if (p := _priced(instance, g, b, shape, slo)) is not None)
        if sum(p.goodput_req_s for p in priced) > sum(p.goodput_req_s for p in best):
            best = priced
    return best


def _priced(instance, group: tuple[int, ...], b: int, shape, slo) -> PricedPipeline | None:  # noqa: ANN001
    result = uniform(subset(instance, group))
    if not result.feasible:
        return None
    pipeline = price(Placement(group, result.solution, "same-type uniform"), instance, b, shape, slo)
    return pipeline if pipeline is not None and pipeline.goodput_req_s > 0 else None
