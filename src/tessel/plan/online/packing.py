"""The most goodput from disjoint pipelines: a set packing over the priced candidates.

Each candidate pipeline uses some devices and serves some goodput; the plan is a set of candidates
that share no device, with the most goodput in all (disjoint pipelines' goodputs add). Depth-first
branch and bound, candidates by goodput: take the next candidate or not; a branch is cut when its
goodput plus a bound on what the free devices can still add does not beat the best so far. The bound
is a fractional knapsack over the free devices: the candidates that fit, best goodput per device
first, the last one in part (no packing of them uses more devices than are free, so none serves
more). At most `MAX_NODES` branches: the search always ends, with the best found (`exact` says
whether it finished).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.plan.online.pipelines import PricedPipeline

MAX_NODES = 200_000


@dataclass(frozen=True, slots=True)
class Packing:
    pipelines: tuple[PricedPipeline, ...]
    exact: bool

    @property
    def goodput_req_s(self) -> float:
        return sum(p.goodput_req_s for p in self.pipelines)


def best_packing(candidates: list[PricedPipeline], max_nodes: int = MAX_NODES) -> Packing:
    items = sorted(
        (p for p in candidates if p.goodput_req_s > 0),
        key=lambda p: (-p.goodput_req_s, len(p.placement.devices)),
    )
    sets = [frozenset(p.placement.devices) for p in items]
    by_density = sorted(range(len(items)), key=lambda i: -items[i].goodput_req_s / len(sets[i]))
    every = frozenset().union(*sets)
    best: list[int] = []
    best_value = 0.0
    nodes = 0

    def bound(start: int, used: frozenset) -> float:
        free = len(every - used)
        total = 0.0
        for i in by_density:
            if i < start or sets[i] & used:
                continue
            size = len(sets[i])
            take = min(1.0, free / size)
            total += take * items[i].goodput_req_s
            free -= size
            if free <= 0:
                break
        return total

    def search(start: int, used: frozenset, chosen: list[int], value: float) -> None:
        nonlocal best, best_value, nodes
        nodes += 1
        if value > best_value:
            best, best_value = list(chosen), value
        for i in range(start, len(items)):
            if nodes >= max_nodes or value + bound(i, used) <= best_value * (1 + 1e-12):
                return  # the bound only falls as i grows
            if sets[i] & used:
                continue
            chosen.append(i)
            search(i + 1, used | sets[i], chosen, value + items[i].goodput_req_s)
            chosen.pop()

    search(0, frozenset(), [], 0.0)
    return Packing(tuple(items[i] for i in best), nodes < max_nodes)
