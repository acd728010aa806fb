"""Brute force over every plan of a tiny instance: the oracle the DP and the MILP are held against.

Enumerates every ordered selection of k distinct devices (k = 1..min(N, U)) and every split of the
U units into k non-empty contiguous runs, and evaluates each with `evaluate`. There are
sum_k N!/(N-k)! * C(U-1, k-1) plans, so keep N <= 5 and U <= 8. With a precision choice, every
plan is tried with every precision per unit too (P^U times as many); with a KV restore choice
(`kv_restore`), a plan that evicts KV is tried with every preemption mode per stage too (2^k for k
stages), so the cheaper mode `evaluate` picks is held against an explicit search. (A plan that evicts
none with the cheaper modes evicts none with dearer ones either: eviction only pays below the
weight-streaming rate, and every mode costs at least the cheaper one.)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from tessel.plan.instance import KV_PREEMPTION_MODES, PlanningInstance
from tessel.plan.solution import Evaluation, Solution, evaluate

MAX_BRUTE_PLANS = 200_000


@dataclass(frozen=True, slots=True)
class BruteResult:
    solution: Solution | None  # None when no plan is feasible
    evaluation: Evaluation | None
    plans_evaluated: int


def count_plans(n_units: int, n_devices: int, n_precisions: int = 1, n_kv_modes: int = 1) -> int:
    placements = sum(
        math.perm(n_devices, k) * math.comb(n_units - 1, k - 1) * n_kv_modes**k
        for k in range(1, min(n_devices, n_units) + 1)
    )
    return placements * n_precisions**n_units


def brute_force(instance: PlanningInstance) -> BruteResult:
    """The feasible plan with the least objective (first found on ties)."""
    n_units, n_devices = instance.n_units, instance.n_devices
    modes = (None,) if instance.kv_restore is None else KV_PREEMPTION_MODES
    total = count_plans(n_units, n_devices, instance.n_precisions)  # (modes only where KV is evicted)
    if total > MAX_BRUTE_PLANS:
        raise ValueError(
            f"brute force would evaluate {total} plans (limit {MAX_BRUTE_PLANS}); use the DP or MILP"
        )
    best: tuple[Solution, Evaluation] | None = None
    evaluated = 0
    vectors = (
        [None] if instance.precision is None else itertools.product(*[range(instance.n_precisions)] * n_units)
    )
    for precisions in vectors:
        for k in range(1, min(n_devices, n_units) + 1):
            for cuts in itertools.combinations(range(1, n_units), k - 1):
                counts = [b - a for a, b in zip((0, *cuts), (*cuts, n_units), strict=True)]
                for devices in itertools.permutations(range(n_devices), k):
                    plan = Solution.from_counts(devices, counts).with_precisions(precisions)
                    cheaper = evaluate(instance, plan)  # the cheaper mode on every stage
                    evicts = any(stage.kv_evicted_bytes > 0 for stage in cheaper.stages)
                    for kv_modes in itertools.product(modes, repeat=k) if evicts else [None]:
                        solution = plan if kv_modes is None else plan.with_kv_modes(kv_modes)
                        evaluation = cheaper if kv_modes is None else evaluate(instance, solution)
                        evaluated += 1
                        if evaluation.feasible and (best is None or evaluation.objective < best[1].objective):
                            best = (solution, evaluation)
    if best is None:
        return BruteResult(None, None, evaluated)
    return BruteResult(best[0], best[1], evaluated)
