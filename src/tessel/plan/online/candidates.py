"""Candidate pipelines for the online planner, on the devices not yet taken.

Groups of devices, each planned as a pipeline in several ways:

- same-type groups: per GPU type, its first s devices (by node) for every s from the fewest that
  hold the model in GPU memory to all of them: Helix's separate pipelines, placed by the uniform
  split (the baseline's placement) and by the planner;
- fastest first: the devices by decode time per layer (then memory), every prefix from the fewest
  that hold the model to `EXTRA_DEVICES` more: a TPOT SLO is met by pipelines whose layers sit
  on fast GPUs, with slower ones only for the memory (KV) they add;
- all the devices left;
- two tiers (`tiers`): the fastest type's GPUs with a few layers on a slower type's, for KV room.

Same-type groups are placed by the even split (alike devices: it is the balanced one); the others
by the planner, unless no placement of theirs can meet the TPOT SLO (`tpot_lower_bound_s`).

The planner (`solve`) places a mixed group for `SOLVE_MICRO_BATCHES` micro-batches in flight (the more in
flight, the more memory it leaves for KV and the more the bottleneck weighs); devices it leaves
idle are dropped from the placement, so they stay free for another pipeline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from tessel.errors import TesselError
from tessel.plan.instance import PlanningInstance, subset, with_micro_batches
from tessel.plan.online.pipelines import Placement
from tessel.plan.online.tiers import tiered_placements
from tessel.plan.replicas.replicas import holds_model, smallest_group
from tessel.plan.solution import Solution, Stage
from tessel.plan.solvers.baselines import uniform
from tessel.plan.solvers.solve import solve

EXTRA_DEVICES = 8  # fastest-first groups: up to this many devices beyond the fewest that hold the model
SOLVE_MICRO_BATCHES = (1, 4, 16, 32, 64)
SOLVE_S = 3.0  # planner time per group and count at most
SOLVE_GAP = 0.02


class CandidatePlacements:
    """Placements of groups of an instance's devices, each planned once and kept."""

    def __init__(
        self,
        instance: PlanningInstance,
        deadline: float,
        tpot_slo_s: float | None = None,
        solver: str = "milp",
    ):
        self.instance = instance  # at the reference micro-batch size, one micro-batch, GPU memory only
        self.deadline = deadline
        self.tpot_slo_s = tpot_slo_s
        self.solver = solver
        self.cache: dict[tuple[int, ...], list[Placement]] = {}

    def placements(self, free: tuple[int, ...]) -> list[Placement]:
        out, seen = [], set()
        planned = (p for group, same_type in self.groups(free) for p in self._of_group(group, same_type))
        tiered = tiered_placements(self.instance, free, self.tpot_slo_s) if self.tpot_slo_s else ()
        for placement in (*planned, *tiered):
            key = (placement.devices, placement.solution.stages)
            if key not in seen:
                seen.add(key)
                out.append(placement)
        return out

    def groups(self, free: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], bool]]:
        """(group, same type) for the devices in `free`."""
        devices = self.instance.devices
        by_type: dict[str, list[int]] = {}
        for j in free:
            by_type.setdefault(devices[j].gpu_type, []).append(j)
        for members in by_type.values():
            members.sort(key=lambda j: (devices[j].node, devices[j].name))
            fewest = smallest_group(self.instance, members)[True]
            for size in range(fewest or len(members) + 1, len(members) + 1):
                yield tuple(members[:size]), True
        decode = np.asarray(self.instance.decode.unit_time_s).mean(axis=0)
        ordered = sorted(free, key=lambda j: (decode[j], -devices[j].memory_bytes, devices[j].node, j))
        fewest = smallest_group(self.instance, ordered)[True]
        if fewest is not None:
            for size in range(fewest, min(len(ordered), fewest + EXTRA_DEVICES) + 1):
                yield tuple(ordered[:size]), False
        if len(by_type) > 1:
            yield tuple(free), False

    def _of_group(self, group: tuple[int, ...], same_type: bool) -> list[Placement]:
        if group not in self.cache:
            self.cache[group] = self._plan(group, same_type)
        return self.cache[group]

    def _plan(self, group: tuple[int, ...], same_type: bool) -> list[Placement]:
        sub = subset(self.instance, group)
        out = []
        if same_type:  # alike devices: the even split is the balanced one
            result = uniform(sub)
            if result.feasible:
                out.append(_used(group, result.solution, "same-type uniform"))
            return out
        if self.tpot_slo_s is not None and tpot_lower_bound_s(self.instance, group) > self.tpot_slo_s:
            return out  # no placement of the group meets the TPOT SLO: not worth a solve
        for k in SOLVE_MICRO_BATCHES:
            left = self.deadline - time.perf_counter()
            if left <= 0 or not holds_model(with_micro_batches(self.instance, k), group, gpu_only=True):
                break
            try:
                part = with_micro_batches(sub, k)
                result = solve(part, solver=self.solver, time_limit_s=min(SOLVE_S, left), mip_gap=SOLVE_GAP)
            except TesselError:
                break
            out.append(_used(group, result.solution, f"planned for {k} in flight"))
        return out


def _used(group: tuple[int, ...], solution: Solution, source: str) -> Placement:
    """The placement on the devices its stages use (idle ones left free), stages re-indexed."""
    stages = tuple(Stage(i, s.unit_start, s.unit_end) for i, s in enumerate(solution.stages))
    devices = tuple(group[s.device] for s in solution.stages)
    return Placement(devices, Solution(stages, solution.precisions, solution.kv_modes), source)


def tpot_lower_bound_s(instance: PlanningInstance, group: tuple[int, ...]) -> float:
    """Least decode pass of one token through every unit on `group`: the units go to the fastest
    devices first, each taking what its memory holds of weights alone (units alike or not, the
    least-time unit cost per device and the least bytes per unit keep it a bound)."""
    unit_bytes = float(np.min(instance.weight_bytes))
    decode = np.asarray(instance.decode.unit_time_s)[:, list(group)].min(axis=0)
    left, total = instance.n_units, 0.0
    for position in np.argsort(decode, kind="stable"):
        held = min(left, int(instance.devices[group[position]].memory_bytes // unit_bytes))
        total += held * decode[position]
        left -= held
        if left == 0:
            return total
    return float("inf")
