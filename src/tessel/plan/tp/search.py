"""Choose tensor-parallel degrees with the layer split: `solve_tp`.

Every grouping of the cluster's GPUs (`tessel.plan.tp.groups`) is a planning problem whose devices
are its groups (`tessel.plan.tp.tp_instance`); the existing solvers (MILP, DP, brute force) plan each
one, and the best plan by the objective wins. The pipeline-only grouping (every GPU alone: today's
problem, unchanged) is solved first, so the answer is never worse than the pipeline-only plan
that the same solver finds, and `max_tp=1` is exactly today's planner. A grouping's plan whose stages
all have degree 1 is a pipeline-only plan too: when better it becomes `pipeline_only` (the baseline
printed beside the chosen plan), so TP is never credited with what the pipeline-only solve missed.

The other groupings are visited in the order of a quick lower bound on their objective
(`quick_bound`: every unit on its fastest device; with alike units, a small LP over fractional unit
counts per device that prices each device's memory and what streams beyond it, but not links, first
and last stages or whole units) and skipped once that bound, within the gap, reaches the best plan
found: none of their plans can be better. The bound reported over every degree
choice is the least of each grouping's own bound (its solver's proven bound when solved, its quick
bound when skipped or not reached in time), so it stays a lower bound over all groupings searched.

Too many groupings (`groups.MAX_GROUPINGS`): each pool at one degree, then one degree for every pool;
the plan is then best over those groupings only (`TpPlan.complete` is False).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from tessel.errors import TesselError
from tessel.plan.instance import PassCosts, PlanningInstance
from tessel.plan.solution import evaluate
from tessel.plan.solvers.solve import PlanResult, solve
from tessel.plan.tp.groups import Grouping, degree_multisets, groupings, pools
from tessel.plan.tp.tp_instance import TpContext, tp_instance

PIPELINE_ONLY_SHARE = 0.4  # of the time limit, for the pipeline-only problem (the baseline plan)
MIN_GROUPING_S = 0.5  # each further grouping gets at least this (the solver's own minimum)


@dataclass(frozen=True, slots=True)
class TpPlan:
    """The best plan over degree choices, on its own instance (devices = its groups)."""

    grouping: Grouping
    instance: PlanningInstance
    result: PlanResult
    pipeline_only: PlanResult | None  # the best pipeline-only plan (base instance); None: none fits
    bound: float | None  # lower bound on the objective over every grouping searched
    solved: int  # groupings planned
    skipped: int  # groupings whose quick bound could not beat the best plan
    out_of_time: int  # groupings not planned: the time limit was reached first
    complete: bool  # every grouping of every pool was searched (not the one-degree fallback)
    infeasible: tuple[str, ...] = field(default=())

    @property
    def gap(self) -> float | None:
        if self.bound is None or self.result.evaluation.objective <= 0:
            return None
        return max(self.result.evaluation.objective - self.bound, 0.0) / self.result.evaluation.objective

    @property
    def degrees(self) -> tuple[int, ...]:
        """The degree of each stage of the chosen plan."""
        return tuple(self.instance.devices[s.stage.device].tp_degree for s in self.result.evaluation.stages)


def tp_possible(cluster, model, max_tp: int) -> bool:  # noqa: ANN001 (Cluster, ModelSpec)
    """Whether any machine of `cluster` can hold a stage of degree > 1 of `model` under `max_tp`."""
    return max_tp > 1 and any(len(pool.degrees) > 1 for pool in pools(cluster, model, max_tp))


def quick_bound(instance: PlanningInstance) -> float:
    """A lower bound on every plan's objective (module docstring); no MILP: every unit on its fastest
    device, and for alike units (whole layers) the LP of `_alike_units_bound`."""
    m = instance.micro_batches
    ends = {}

    def makespan(costs: PassCosts) -> float:
        fastest = costs.unit_time_s.min(axis=1)
        ends[id(costs)] = float(costs.first_time_s.min() + costs.last_time_s.min())
        return float(fastest.sum()) + ends[id(costs)] + (m - 1) * float(fastest.max())

    pw, dw = instance.prefill_weight, instance.decode_weight
    bound = pw * makespan(instance.prefill) + dw * makespan(instance.decode)
    relaxed = _alike_units_bound(instance)
    if relaxed is not None:
        bound = max(bound, relaxed + pw * ends[id(instance.prefill)] + dw * ends[id(instance.decode)])
    return bound


MS_PER_S = 1e3  # the LP in milliseconds keeps its coefficients near 1


def _alike_units_bound(instance: PlanningInstance) -> float | None:
    """With alike units (same times and bytes: whole layers), the LP over fractional unit counts n_j:

        minimise  pw (sum_j y_j^pre + (m - 1) tau^pre) + dw (sum_j y_j^dec + (m - 1) tau^dec)
        s.t.      sum_j n_j = U,   tau >= y_j >= f_j(n_j) in each pass,

    f_j convex piecewise linear: n t_j for the units its memory holds (less its workspace), then each
    further unit's bytes streamed at its fastest offload rate (added, or with `overlap` the larger of
    compute and stream); no host memory: n_j <= what it holds. Every plan is a point of it (stage
    times only add first/last stages, links, whole units and whole streamed layers), so its value is a
    bound on the unit terms of the objective. None when units differ or the LP has no solution."""
    from tessel.plan.solvers.highs import solve_lp

    passes = (instance.prefill, instance.decode)
    unit_bytes = instance.weight_bytes + instance.kv_bytes
    if instance.move_s is not None or instance.precision is not None:
        return None
    if not all(np.allclose(c.unit_time_s, c.unit_time_s[0]) for c in passes) or not np.allclose(
        unit_bytes, unit_bytes[0]
    ):
        return None
    n, per = instance.n_devices, float(unit_bytes[0])
    # columns: n_j (0..n-1), y_j per pass (n..3n-1), tau per pass (3n, 3n+1)
    weights = (instance.prefill_weight, instance.decode_weight)
    cost = [0.0] * n + [w for w in weights for _ in range(n)]
    cost += [w * (instance.micro_batches - 1) for w in weights]
    upper = [np.inf] * (3 * n + 2)
    rows, cols, vals, lower_rows, upper_rows = [], [], [], [], []

    def row(entries: list[tuple[int, float]], low: float, high: float = np.inf) -> None:
        for col, val in entries:
            rows.append(len(lower_rows))
            cols.append(col)
            vals.append(val)
        lower_rows.append(low)
        upper_rows.append(high)

    row([(j, 1.0) for j in range(n)], instance.n_units, instance.n_units)
    for j, slot in enumerate(instance.devices):
        fits = max(slot.memory_bytes - float(instance.workspace_bytes[j]), 0.0) / per if per > 0 else np.inf
        stream_ms = MS_PER_S * per / instance.offload_bytes_per_s_bound(j) if slot.host_bytes > 0 else np.inf
        if not np.isfinite(stream_ms):
            upper[j] = fits
        for q, costs in enumerate(passes):
            y, tau, t_ms = n + q * n + j, 3 * n + q, MS_PER_S * float(costs.unit_time_s[0, j])
            row([(y, 1.0), (j, -t_ms)], 0.0)  # y >= n t
            if np.isfinite(stream_ms) and np.isfinite(fits):
                if instance.overlap:  # y >= (n - fits) stream
                    row([(y, 1.0), (j, -stream_ms)], -stream_ms * fits)
                else:  # y >= n t + (n - fits) stream
                    row([(y, 1.0), (j, -(t_ms + stream_ms))], -stream_ms * fits)
            row([(tau, 1.0), (y, -1.0)], 0.0)
    value = solve_lp(cost, [0.0] * len(cost), upper, rows, cols, vals, lower_rows, upper_rows)
    return None if value is None else value / MS_PER_S


def solve_tp(
    base: PlanningInstance,
    ctx: TpContext,
    max_tp: int,
    *,
    solver: str = "milp",
    time_limit_s: float = 10.0,
    mip_gap: float = 0.01,
) -> TpPlan:
    """The best plan over the groupings `max_tp` allows (module docstring)."""
    started = time.perf_counter()
    cluster_pools = pools(ctx.cluster, ctx.model, max_tp)
    candidates = groupings(cluster_pools)
    complete = math.prod(len(degree_multisets(len(p.devices), p.degrees)) for p in cluster_pools) == len(
        candidates
    )
    alone = candidates[0]
    share = time_limit_s if len(candidates) == 1 else time_limit_s * PIPELINE_ONLY_SHARE
    try:
        pipeline_only = solve(base, solver=solver, time_limit_s=share, mip_gap=mip_gap)
    except TesselError:
        if len(candidates) == 1:
            raise
        pipeline_only = None  # no pipeline-only plan: a grouping with TP stages may still fit
    best = None if pipeline_only is None else (alone, base, pipeline_only)
    bounds = [-np.inf if pipeline_only is None or pipeline_only.bound is None else pipeline_only.bound]
    instances = [(quick_bound(inst), g, inst) for g, inst in _tp_instances(base, ctx, candidates[1:])]
    instances.sort(key=lambda entry: entry[0])
    solved, skipped, out_of_time, infeasible = 1, 0, 0, []
    for position, (bound, grouping, instance) in enumerate(instances):
        objective = np.inf if best is None else best[2].evaluation.objective
        left_s = time_limit_s - (time.perf_counter() - started)
        if bound * (1 + mip_gap) >= objective or left_s < MIN_GROUPING_S:
            bounds.extend(b for b, _g, _i in instances[position:])
            if left_s < MIN_GROUPING_S and bound * (1 + mip_gap) < objective:
                out_of_time += len(instances) - position
            else:
                skipped += len(instances) - position
            break
        seconds = max(left_s / (len(instances) - position), MIN_GROUPING_S)
        try:
            result = solve(instance, solver=solver, time_limit_s=seconds, mip_gap=mip_gap)
        except TesselError as error:  # no plan found: its quick bound still counts
            infeasible.append(f"{_label(grouping)}: {error}")
            bounds.append(bound)
            continue
        solved += 1
        bounds.append(max(bound, result.bound) if result.bound is not None else bound)
        if result.evaluation.objective < objective:
            best = (grouping, instance, result)
        pipeline_only = _better_pipeline_only(base, instance, result, pipeline_only)
    if best is None:
        raise TesselError(f"no feasible plan with any tensor-parallel grouping: {'; '.join(infeasible)}")
    bound = min(bounds) if all(np.isfinite(bounds)) else None
    return TpPlan(
        best[0],
        best[1],
        best[2],
        pipeline_only,
        bound,
        solved,
        skipped,
        out_of_time,
        complete,
        tuple(infeasible),
    )


def _better_pipeline_only(
    base: PlanningInstance, instance: PlanningInstance, result: PlanResult, pipeline_only: PlanResult | None
) -> PlanResult | None:
    """A plan whose stages all have degree 1 is a pipeline-only plan: it replaces `pipeline_only` when
    better (the pipeline-only solve may stop at its time share before finding it)."""
    slots = [instance.devices[se.stage.device] for se in result.evaluation.stages]
    if any(slot.tp_degree > 1 for slot in slots):
        return pipeline_only
    index = {slot.name: j for j, slot in enumerate(base.devices)}
    stages = tuple(replace(s, device=index[instance.devices[s.device].name]) for s in result.solution.stages)
    solution = replace(result.solution, stages=stages)
    evaluation = evaluate(base, solution)
    if pipeline_only is not None and evaluation.objective >= pipeline_only.evaluation.objective:
        return pipeline_only
    bound = None if pipeline_only is None else pipeline_only.bound  # the pipeline-only problem's own
    gap = None if bound is None else max(evaluation.objective - bound, 0.0) / evaluation.objective
    detail = {**result.detail, "plan_from": "tp search"}
    return replace(result, solution=solution, evaluation=evaluation, bound=bound, gap=gap, detail=detail)


def _tp_instances(base: PlanningInstance, ctx: TpContext, candidates: list[Grouping]):
    cache: dict = {}
    for grouping in candidates:
        yield grouping, tp_instance(base, ctx, grouping, cache)


def _label(grouping: Grouping) -> str:
    return " | ".join("+".join(group) for group in grouping if len(group) > 1) or "every GPU alone"
