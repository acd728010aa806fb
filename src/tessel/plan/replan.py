"""Re-planning: a new workload arrives while a plan is serving; move to a new plan only if it pays.

Moving weights costs time: unit u going from its previous device i to device j sends its weight
bytes over the cluster link i -> j (`latency + bytes / bandwidth`); the embedding moves when the
first stage changes device, the LM head when the last one does. KV is not moved: requests in flight
finish where they are. The planner then solves the new workload's instance with

    objective + move_weight * move_s,    move_weight = reference objective / horizon_s

i.e. the move amortised over the rounds the new plan serves: one objective is the time of one
round of m micro-batches, so `horizon_s` seconds of serving are about horizon_s / objective rounds
and each pays move_s / rounds. The reference objective is the previous plan's under the new
workload (or, when that plan no longer fits, a plan solved without move costs).

The new plan is taken when the previous one no longer fits, or when
    gain = (previous objective - new objective with its amortised move) / previous objective
reaches `threshold`; otherwise the previous plan stays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tessel.cost.link import link_time_s
from tessel.errors import TesselError
from tessel.plan.cluster import Cluster
from tessel.plan.instance import PlanningInstance
from tessel.plan.plan_file import PlanStage
from tessel.plan.solution import Evaluation, Solution, Stage, evaluate
from tessel.plan.solve import PlanResult, solve


@dataclass(frozen=True, slots=True)
class ReplanDecision:
    previous: Solution
    previous_evaluation: Evaluation  # the previous plan under the new workload (may be infeasible)
    new: PlanResult  # the best plan with the amortised move cost in its objective
    move_bytes: float  # weights the new plan moves
    move_s: float  # seconds they take (sum over units of link time)
    gain: float  # (previous - new) / previous, new including its amortised move; inf if previous fails
    take_new: bool
    reason: str

    @property
    def chosen(self) -> PlanResult:
        if self.take_new:
            return self.new
        return PlanResult(
            self.previous,
            self.previous_evaluation,
            "previous",
            "kept",
            None,
            None,
            self.new.time_s,
            {"replan": self.reason},
        )


def previous_solution(instance: PlanningInstance, stages: Sequence[PlanStage], source: str) -> Solution:
    """The stages of a plan file (`tessel.plan.plan_file.load_plan`) as a solution of `instance`
    (devices by name)."""
    index = {device.name: j for j, device in enumerate(instance.devices)}
    result = []
    for position, stage in enumerate(stages):
        if stage.device not in index:
            raise TesselError(f"{source}: stage {position}: device {stage.device!r} is not in this cluster")
        result.append(Stage(index[stage.device], stage.unit_start, stage.unit_end))
    solution = Solution(tuple(result))
    try:
        solution.validate(instance)
    except ValueError as error:
        raise TesselError(
            f"{source}: its stages do not fit this model's {instance.n_units} units ({error}); "
            "re-plan with the same model and granularity"
        ) from None
    return solution


def move_costs(
    instance: PlanningInstance, cluster: Cluster, previous: Solution
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds and bytes to bring each unit onto each device, [U, N] each (0 where it already is).

    Unit u on device j needs its weights from their previous device unless that is j; unit 0 also
    needs the embedding unless j was the first stage, unit U-1 the LM head unless j was the last."""
    U, N = instance.n_units, instance.n_devices
    owner = previous.assignment(U)
    names = [device.name for device in instance.devices]
    first, last = previous.stages[0].device, previous.stages[-1].device
    seconds, moved = np.zeros((U, N)), np.zeros((U, N))
    for u in range(U):
        for j in range(N):
            parts = [(owner[u], float(instance.weight_bytes[u]))]
            if u == 0:
                parts.append((first, instance.first_bytes))
            if u == U - 1:
                parts.append((last, instance.last_bytes))
            for source, n_bytes in parts:
                if source != j and n_bytes > 0:
                    moved[u, j] += n_bytes
                    seconds[u, j] += link_time_s(cluster.link(names[source], names[j]), n_bytes)
    return seconds, moved


def replan(
    instance: PlanningInstance,
    cluster: Cluster,
    previous: Solution,
    *,
    threshold: float = 0.05,
    horizon_s: float = 3600.0,
    solver: str = "milp",
    time_limit_s: float = 10.0,
    mip_gap: float = 0.01,
) -> ReplanDecision:
    """Decide between the previous plan and a new one for `instance`'s (new) workload."""
    if horizon_s <= 0:
        raise TesselError(f"the re-planning horizon must be positive, got {horizon_s} s")
    if threshold < 0:
        raise TesselError(f"the re-planning threshold must be >= 0, got {threshold}")
    old = evaluate(instance, previous)
    reference = old.objective
    if not old.feasible:
        reference = solve(
            instance, solver=solver, time_limit_s=time_limit_s, mip_gap=mip_gap
        ).evaluation.objective
    seconds, moved = move_costs(instance, cluster, previous)
    costed = replace(instance, move_s=seconds, move_weight=reference / horizon_s)
    new = solve(costed, solver=solver, time_limit_s=time_limit_s, mip_gap=mip_gap, incumbent=previous)
    move_bytes = float(sum(np.sum(moved[s.unit_start : s.unit_end, s.device]) for s in new.solution.stages))
    if not old.feasible:
        reason = "the previous plan does not fit the new workload: " + "; ".join(old.reasons)
        return ReplanDecision(previous, old, new, move_bytes, new.evaluation.move_s, np.inf, True, reason)
    gain = (old.objective - new.evaluation.objective) / old.objective
    take = gain >= threshold and new.solution != previous
    if take:
        reason = (
            f"the new plan gains {gain:.1%} after its amortised move, at least the {threshold:.1%} threshold"
        )
    else:
        reason = (
            f"the new plan gains {gain:.1%} after its amortised move, below the {threshold:.1%} threshold"
        )
    return ReplanDecision(previous, old, new, move_bytes, new.evaluation.move_s, gain, take, reason)
