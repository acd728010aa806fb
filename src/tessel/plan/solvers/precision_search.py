"""Choosing a precision per unit: exact by enumeration on small instances, a local search at scale.

With the precision of every unit fixed, the instance is an ordinary one (`PlanningInstance.fixed`)
that the DP and the counts relaxation solve; the quality term theta * cost is then a constant.

- `enumerate_dp`: every precision vector within the budget (P^U of them, `MAX_ENUMERATED`), each
  fixed instance solved by the DP; exact when every DP is. This is what `solve_dp` runs on small
  instances, and what the tests hold against brute force.
- `local_search` (larger instances): a placement from the relaxed instance (every unit at its least
  bytes and time, `PlanningInstance.relaxed`), then two starts: on it, units put at their fewest
  bytes slowest stage first while the budget allows (`fill_budget`); and every unit at the
  reference on the reference instance's own plan. Each
  start is then improved one move at a time (one unit's precision, or one unit across a stage
  boundary; best first), re-placed by the fixed-instance solver, and improved again. The relaxed
  instance's lower bound (+ theta times the least quality cost) bounds every plan, so the gap it
  reports is proven; it is loose when the budget binds, since the relaxation may quantise every unit.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import FEASIBILITY_RTOL, Evaluation, Solution, Stage, evaluate

MAX_ENUMERATED = 729  # 3 precisions x 6 units
MAX_LOCAL_STEPS = 400
FOCUS_STAGES = 4  # precision moves are tried on the slowest stages of each pass and on offloading ones
REPLACE_MAX_CELLS = 16 * 80  # re-place a mixed vector (DP on unlike units) only up to units x devices
_INF = float("inf")

# (fixed instance, seconds) -> (plan or None, proven lower bound on the fixed instance's objective)
FixedSolver = Callable[[PlanningInstance, float], tuple[Solution | None, float]]


@dataclass(frozen=True, slots=True)
class PrecisionSearch:
    solution: Solution | None
    evaluation: Evaluation | None
    bound: float  # proven lower bound on every plan's objective (-inf / inf: none proven / no plan)
    exact: bool
    vectors: int  # precision vectors solved


def within_budget(instance: PlanningInstance, quality: float) -> bool:
    budget = instance.precision.quality_budget
    return quality <= budget * (1 + FEASIBILITY_RTOL) + 1e-12


def enumerate_dp(instance: PlanningInstance, solve_fixed, time_limit_s: float) -> PrecisionSearch:
    """Best plan over every precision vector within the budget; `solve_fixed` returns
    (plan, lower bound, exact) for a fixed instance."""
    deadline = time.perf_counter() + time_limit_s
    theta = instance.precision.theta
    best: tuple[Solution, Evaluation] | None = None
    bound, exact, count = _INF, True, 0
    for vector in itertools.product(range(instance.n_precisions), repeat=instance.n_units):
        quality = instance.quality_cost(vector)
        if not within_budget(instance, quality):
            continue
        left = deadline - time.perf_counter()
        if left <= 0:
            return PrecisionSearch(*(best or (None, None)), -_INF, False, count)
        solution, fixed_bound, fixed_exact = solve_fixed(instance.fixed(vector), left)
        count += 1
        exact = exact and fixed_exact
        bound = min(bound, fixed_bound + theta * quality)
        if solution is None:
            continue
        evaluation = evaluate(instance, solution.with_precisions(vector))
        if evaluation.feasible and (best is None or evaluation.objective < best[1].objective):
            best = (solution.with_precisions(vector), evaluation)
    if best is None:
        return PrecisionSearch(None, None, bound, exact, count)
    return PrecisionSearch(best[0], best[1], min(bound, best[1].objective), exact, count)


def local_search(
    instance: PlanningInstance, solve_fixed: FixedSolver, time_limit_s: float
) -> PrecisionSearch:
    """A good plan and a proven lower bound for instances too large to enumerate."""
    started = time.perf_counter()
    deadline = started + time_limit_s
    choice = instance.precision
    relaxed_plan, relaxed_bound = solve_fixed(instance.relaxed(), 0.3 * time_limit_s)
    least_quality = float(choice.quality.min(axis=1).sum())
    bound = relaxed_bound + choice.theta * least_quality if math.isfinite(relaxed_bound) else -_INF
    if relaxed_plan is None:
        return PrecisionSearch(None, None, _INF if relaxed_bound == _INF else bound, False, 0)
    reference = solve_fixed(instance.fixed(None), 0.2 * time_limit_s)[0]
    starts = [(relaxed_plan, fill_budget(instance, relaxed_plan))]
    if reference is not None:
        starts.append((reference, np.zeros(instance.n_units, dtype=int)))
    best: tuple[Solution, Evaluation] | None = None
    count = 0
    for placement, vector in starts:
        for round_index in range(2):
            placement, vector = _improve(instance, placement, vector, deadline)
            candidate = placement.with_precisions(vector)
            evaluation = evaluate(instance, candidate)
            count += 1
            if evaluation.feasible and (best is None or evaluation.objective < best[1].objective):
                best = (candidate, evaluation)
            left = deadline - time.perf_counter()
            too_big = instance.n_units * instance.n_devices > REPLACE_MAX_CELLS
            if round_index == 1 or left <= 0 or too_big:
                break
            placed, _ = solve_fixed(instance.fixed(vector), left / 2)
            if placed is None:
                break
            placement = placed
    if best is None:
        return PrecisionSearch(None, None, bound, False, count)
    return PrecisionSearch(best[0], best[1], min(bound, best[1].objective), False, count)


def fill_budget(instance: PlanningInstance, placement: Solution) -> np.ndarray:
    """Units at their fewest bytes, slowest stages (decode, then prefill) first and inside a stage
    the units that cost least quality first, while the budget allows; the rest at the reference."""
    choice = instance.precision
    vector = np.zeros(instance.n_units, dtype=int)
    evaluation = evaluate(instance.fixed(vector), placement)
    order = sorted(
        range(len(placement.stages)),
        key=lambda i: (-evaluation.stages[i].time_decode_s, -evaluation.stages[i].time_prefill_s),
    )
    fewest = np.argmin(choice.weight_bytes, axis=1)
    spent = instance.quality_cost(vector)
    for i in order:
        stage = placement.stages[i]
        units = np.arange(stage.unit_start, stage.unit_end)
        extra = choice.quality[units, fewest[units]] - choice.quality[units, 0]
        for u, cost in sorted(zip(units, extra, strict=True), key=lambda pair: pair[1]):
            if within_budget(instance, spent + cost):
                vector[u] = fewest[u]
                spent += cost
    return vector


def _focus(instance: PlanningInstance, placement: Solution, vector: np.ndarray) -> list:
    """The stages worth changing: the `FOCUS_STAGES` slowest of each pass and every offloading one."""
    evaluation = evaluate(instance.fixed(vector), placement)
    stages = evaluation.stages
    chosen = {i for i, se in enumerate(stages) if se.offload_bytes > 0}
    for key in (lambda i: -stages[i].time_decode_s, lambda i: -stages[i].time_prefill_s):
        chosen.update(sorted(range(len(stages)), key=key)[:FOCUS_STAGES])
    return [placement.stages[i] for i in sorted(chosen)]


def _candidates(instance: PlanningInstance, placement: Solution, vector: np.ndarray, stages=None):
    """One move per (stage, precision): the unit of the stage whose quality cost that change
    raises least (or lowers most)."""
    quality = instance.precision.quality
    for stage in placement.stages if stages is None else stages:
        units = np.arange(stage.unit_start, stage.unit_end)
        for q in range(instance.n_precisions):
            movable = units[vector[units] != q]
            if movable.size == 0:
                continue
            delta = quality[movable, q] - quality[movable, vector[movable]]
            u = int(movable[np.argmin(delta)])
            yield u, q, float(delta.min())


def _shifts(placement: Solution):
    """Plans with one unit moved across one boundary between neighbouring stages."""
    stages = list(placement.stages)
    for i in range(len(stages) - 1):
        left, right = stages[i], stages[i + 1]
        for step in (-1, 1):  # -1: left gives its last unit, +1: right gives its first
            cut = left.unit_end + step
            if left.unit_start < cut < right.unit_end:
                moved = stages.copy()
                moved[i] = Stage(left.device, left.unit_start, cut)
                moved[i + 1] = Stage(right.device, cut, right.unit_end)
                yield Solution(tuple(moved))


def _improve(instance: PlanningInstance, placement: Solution, vector: np.ndarray, deadline: float):
    """Best-first local search: one unit's precision changed, or one unit moved across a stage
    boundary, while that lowers the objective within the budget. Returns (placement, vector)."""
    vector = vector.copy()
    current = evaluate(instance, placement.with_precisions(vector))
    for _ in range(MAX_LOCAL_STEPS):
        if time.perf_counter() > deadline:
            break
        best = None
        trials = []
        for u, q, _delta in _candidates(instance, placement, vector, _focus(instance, placement, vector)):
            trial = vector.copy()
            trial[u] = q
            trials.append((placement, trial))
        trials += [(moved, vector) for moved in _shifts(placement)]
        for plan, trial in trials:
            evaluation = evaluate(instance, plan.with_precisions(trial))
            if evaluation.feasible and evaluation.objective < (best or current).objective * (1 - 1e-9):
                best, best_move = evaluation, (plan, trial)
        if best is None:
            break
        current, (placement, vector) = best, best_move
    return placement, vector


def smallest_feasible_budget(instance: PlanningInstance, time_limit_s: float = 10.0) -> tuple[float, float]:
    """(least quality cost of a feasible plan found, proven lower bound on it); (inf, inf) when no
    plan fits at any budget. A MILP whose objective is the quality cost alone."""
    from dataclasses import replace

    from tessel.plan.solvers.milp import solve_milp

    choice = replace(instance.precision, quality_budget=_INF, theta=1.0)
    only_quality = replace(instance, precision=choice, prefill_weight=0.0, decode_weight=0.0, move_weight=0.0)
    result = solve_milp(only_quality, time_limit_s=time_limit_s, mip_gap=1e-4, isolate=True)
    if result.evaluation is None:
        return (_INF, _INF) if result.status == "Infeasible" else (_INF, -_INF)
    return result.evaluation.quality, max(result.bound, 0.0)
