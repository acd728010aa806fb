"""Brute force over degrees and layer splits: the oracle `solve_tp` is held against.

Every partition of every machine's GPUs of one type into groups of allowed degrees, GPUs told apart
(`groups.every_partition`: no interchangeability assumed, unlike the search), and for each, every plan
of its groups (`tessel.plan.solvers.brute.brute_force`: every ordered selection of groups and every
contiguous split). Tiny clusters only.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import Evaluation, Solution
from tessel.plan.solvers.brute import brute_force
from tessel.plan.tp.groups import Grouping, every_partition, pools
from tessel.plan.tp.tp_instance import TpContext, tp_instance


@dataclass(frozen=True, slots=True)
class TpBruteResult:
    grouping: Grouping | None  # None when no plan is feasible
    instance: PlanningInstance | None
    solution: Solution | None
    evaluation: Evaluation | None
    groupings: int  # partitions tried


def brute_force_tp(base: PlanningInstance, ctx: TpContext, max_tp: int) -> TpBruteResult:
    """The feasible plan with the least objective over every grouping and every plan of it."""
    best = TpBruteResult(None, None, None, None, 0)
    tried = 0
    for grouping in every_partition(pools(ctx.cluster, ctx.model, max_tp)):
        tried += 1
        instance = tp_instance(base, ctx, grouping)
        found = brute_force(instance)
        if found.solution is None:
            continue
        if best.evaluation is None or found.evaluation.objective < best.evaluation.objective:
            best = TpBruteResult(grouping, instance, found.solution, found.evaluation, 0)
    return TpBruteResult(best.grouping, best.instance, best.solution, best.evaluation, tried)
