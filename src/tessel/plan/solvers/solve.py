"""One entry point over the solvers: `solve(instance, solver=...)` -> `PlanResult`.

- `milp` (default): first the counts relaxation (`tessel.plan.solvers.bound`, when all units are alike:
  whole layers) gives a lower bound on every plan and the plans it meets; when its bound proves
  the requested gap for the best of those plans and the baselines, that plan is returned
  (status "gap reached", HiGHS not run). Otherwise the DP runs for a share of the time left
  (`DP_SHARE`, with a 1% gap target), the best plan so far warm-starts HiGHS, which gets the
  rest, and the best plan of all is kept. The gap is proven against the larger of HiGHS's dual
  bound and the counts bound.
- `dp`: the DP alone (exact over the searched orders when it finishes with gap 0).
- `brute`: every plan (tiny instances only).

With a precision choice (`instance.precision`), `milp` first picks the precisions
(`tessel.plan.solvers.precision_search`: every precision vector on small instances, a local search over
plans of the fixed-precision instances, each solved as above, at scale), then hands the best plan to
HiGHS's precision MILP as a warm start when that model is small enough (`MAX_PRECISION_MILP_COLS`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from tessel.errors import TesselError
from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import Evaluation, Solution, evaluate
from tessel.units import GIB

SOLVERS = ("milp", "dp", "brute")
COUNTS_SHARE = 0.7  # fraction of the time limit the counts relaxation search gets first (it alone proves
# small gaps at 16+ devices, and needs ~1 CPU-s there: 7 s holds beside two busy processes)
COUNTS_GAP_SHARE = 0.9  # it aims a little under the requested gap, so float rounding leaves room
DP_SHARE = 0.25  # fraction of the time left that the DP gets before the MILP
DP_WARM_START_GAP = 0.01
MAX_PRECISION_MILP_BINARIES = 4000  # HiGHS gets the precision MILP only below this many z[u, j, q]
PRECISION_SEARCH_SHARE = 0.7  # of the time limit, when HiGHS runs after the precision search
HIGHS_MIN_S = 3.0  # HiGHS runs in a fresh interpreter (seconds to start): not worth less than this


@dataclass(frozen=True, slots=True)
class PlanResult:
    solution: Solution
    evaluation: Evaluation
    solver: str
    status: str
    gap: float | None  # proven relative gap to the solver's lower bound (None: no bound)
    bound: float | None
    time_s: float
    detail: dict  # solver-specific numbers (DP calls, MILP size, which solver's plan won)


def solve(
    instance: PlanningInstance,
    *,
    solver: str = "milp",
    time_limit_s: float = 30.0,
    mip_gap: float = 0.01,
    incumbent: Solution | None = None,
) -> PlanResult:
    """Plan `instance`; raises TesselError when no feasible plan exists (or none was found).

    `incumbent` (e.g. the plan serving now, when re-planning) is a candidate too: the result is never
    worse than it when it is feasible."""
    if solver not in SOLVERS:
        raise TesselError(f"unknown solver {solver!r}; use one of {', '.join(SOLVERS)}")
    started = time.perf_counter()
    try:
        if solver == "brute":
            result = _brute(instance, started)
        elif solver == "dp":
            result = _dp(instance, started, time_limit_s, mip_gap)
        else:
            result = _milp(instance, started, time_limit_s, mip_gap, incumbent)
    except TesselError as error:
        raise _budget_error(instance) or error from None
    if incumbent is not None:
        given = evaluate(instance, incumbent)
        if given.feasible and given.objective < result.evaluation.objective:
            gap = None if result.bound is None else _gap(given.objective, result.bound)
            detail = {**result.detail, "plan_from": "incumbent"}
            return PlanResult(
                incumbent, given, result.solver, result.status, gap, result.bound, result.time_s, detail
            )
    return result


def _brute(instance: PlanningInstance, started: float) -> PlanResult:
    from tessel.plan.solvers.brute import brute_force

    try:
        result = brute_force(instance)
    except ValueError as error:
        raise TesselError(f"{error}") from None
    if result.solution is None:
        raise _infeasible(instance, "brute force found no feasible plan")
    return PlanResult(
        result.solution,
        result.evaluation,
        "brute",
        "optimal",
        0.0,
        result.evaluation.objective,
        time.perf_counter() - started,
        {"plans_evaluated": result.plans_evaluated},
    )


def _dp(instance: PlanningInstance, started: float, time_limit_s: float, gap: float) -> PlanResult:
    from tessel.plan.solvers.dp import solve_dp

    result = solve_dp(instance, time_limit_s=time_limit_s, rel_gap=0.0 if gap <= 0 else gap)
    if result.solution is None:
        raise _infeasible(instance, "the DP found no feasible plan")
    objective = result.evaluation.objective
    proven = (objective - result.bound) / objective if math.isfinite(result.bound) and objective else None
    status = (
        "optimal"
        if result.exact
        else ("gap reached" if proven is not None and proven <= gap else "time limit")
    )
    detail = {
        "dp_calls": result.dp_calls,
        "orders_searched": result.orders_searched,
        "orders_total": result.orders_total,
        "exact": result.exact,
    }
    return PlanResult(
        result.solution,
        result.evaluation,
        "dp",
        status,
        proven,
        result.bound,
        time.perf_counter() - started,
        detail,
    )


def _milp(
    instance: PlanningInstance, started: float, time_limit_s: float, gap: float, incumbent: Solution | None
) -> PlanResult:
    from tessel.plan.solvers.baselines import run_baselines
    from tessel.plan.solvers.bound import counts_search
    from tessel.plan.solvers.dp import solve_dp
    from tessel.plan.solvers.milp import solve_milp

    if instance.precision is not None:
        return _milp_precisions(instance, started, time_limit_s, gap, incumbent)
    counts = counts_search(
        instance,
        incumbent=incumbent,
        rel_gap=gap * COUNTS_GAP_SHARE,
        time_limit_s=time_limit_s * COUNTS_SHARE,
    )
    detail = {"counts_bound": _finite(counts.bound), "counts_knapsacks": counts.knapsacks}
    heuristics = [(counts.evaluation, counts.solution, "counts")]
    if incumbent is not None:
        heuristics.append((evaluate(instance, incumbent), incumbent, "incumbent"))
    heuristics += [(b.evaluation, b.solution, name) for name, b in run_baselines(instance).items()]
    heuristics = [h for h in heuristics if h[0] is not None and h[0].feasible]
    best = min(heuristics, key=lambda h: h[0].objective, default=None)
    if best is not None and _gap(best[0].objective, counts.bound) <= gap:
        detail.update(plan_from=best[2], highs="not run: the counts bound proves the gap")
        proven = _gap(best[0].objective, counts.bound)
        elapsed = time.perf_counter() - started
        return PlanResult(best[1], best[0], "milp", "gap reached", proven, counts.bound, elapsed, detail)
    left = max(time_limit_s - (time.perf_counter() - started), 0.0)
    # HiGHS starts an interpreter and builds the model before it solves: with too little time left
    # it would overrun the limit, so the DP gets all of it and HiGHS is skipped
    highs_fits = left * (1 - DP_SHARE) >= HIGHS_MIN_S
    dp = solve_dp(instance, time_limit_s=left * DP_SHARE if highs_fits else left, rel_gap=DP_WARM_START_GAP)
    if dp.evaluation is not None and dp.evaluation.feasible:
        heuristics.append((dp.evaluation, dp.solution, "dp"))
    detail.update(dp_objective=dp.evaluation.objective if dp.evaluation else None, dp_calls=dp.dp_calls)
    if not highs_fits and heuristics:
        evaluation, solution, source = min(heuristics, key=lambda h: h[0].objective)
        detail.update(plan_from=source, highs=f"not run: {left:.1f} s left of the time limit after the bound")
        bound = _finite(counts.bound)
        proven = _gap(evaluation.objective, bound) if bound is not None else None
        status = "gap reached" if proven is not None and proven <= gap else "Time limit reached"
        elapsed = time.perf_counter() - started
        return PlanResult(solution, evaluation, "milp", status, proven, bound, elapsed, detail)
    warm = min(heuristics, key=lambda h: h[0].objective)[1] if heuristics else None
    remaining = time_limit_s - (time.perf_counter() - started)
    milp = solve_milp(instance, time_limit_s=max(remaining, 1.0), mip_gap=gap, warm_start=warm, isolate=True)
    detail.update(
        milp_cols=milp.n_cols,
        milp_rows=milp.n_rows,
        warm_started=milp.warm_started,
        highs_objective=milp.objective,
        highs_bound=_finite(milp.bound),
    )
    candidates = heuristics
    if milp.evaluation is not None and milp.evaluation.feasible:
        candidates = [(milp.evaluation, milp.solution, "milp"), *heuristics]
    if not candidates:
        if milp.status == "Infeasible":
            raise _infeasible(instance, "the MILP proved that no plan fits")
        raise _infeasible(instance, f"no feasible plan found (DP: none; HiGHS: {milp.status})")
    evaluation, solution, source = min(candidates, key=lambda c: c[0].objective)
    detail["plan_from"] = source
    bounds = [b for b in (milp.bound, counts.bound) if math.isfinite(b)]
    bound = max(bounds) if bounds else None
    proven = _gap(evaluation.objective, bound) if bound is not None else None
    status = milp.status
    if proven is not None and proven <= gap and status != "Optimal":
        status = "gap reached"
    return PlanResult(
        solution, evaluation, "milp", status, proven, bound, time.perf_counter() - started, detail
    )


def _milp_precisions(
    instance: PlanningInstance, started: float, time_limit_s: float, gap: float, incumbent: Solution | None
) -> PlanResult:
    from tessel.plan.solvers.milp import solve_milp
    from tessel.plan.solvers.precision_search import MAX_ENUMERATED, enumerate_dp, local_search

    binaries = instance.n_units * instance.n_devices * instance.n_precisions
    run_highs = binaries <= MAX_PRECISION_MILP_BINARIES
    budget_s = time_limit_s * (PRECISION_SEARCH_SHARE if run_highs else 1.0)

    def solve_fixed(fixed: PlanningInstance, seconds: float):
        """The counts relaxation and its plans when the units are alike, else the DP with a gap."""
        from tessel.plan.solvers.bound import counts_search, units_alike
        from tessel.plan.solvers.dp import solve_dp

        if units_alike(fixed):
            counts = counts_search(fixed, rel_gap=gap * COUNTS_GAP_SHARE, time_limit_s=seconds)
            return counts.solution, counts.bound, False
        result = solve_dp(fixed, time_limit_s=seconds, rel_gap=max(gap, DP_WARM_START_GAP))
        return result.solution, result.bound, result.exact

    if instance.n_precisions**instance.n_units <= MAX_ENUMERATED:
        from tessel.plan.solvers.dp import solve_dp

        def solve_small(fixed: PlanningInstance, seconds: float):
            result = solve_dp(fixed, time_limit_s=seconds)
            return result.solution, result.bound, result.exact

        search = enumerate_dp(instance, solve_small, budget_s)
    else:
        search = local_search(instance, lambda fixed, s: solve_fixed(fixed, s)[:2], budget_s)
    detail = {"precision_vectors": search.vectors, "precision_bound": _finite(search.bound)}
    candidates = []
    if search.evaluation is not None:
        candidates.append((search.evaluation, search.solution, "precision search"))
    if incumbent is not None:
        given = evaluate(instance, incumbent)
        if given.feasible:
            candidates.append((given, incumbent, "incumbent"))
    bounds = [search.bound] if math.isfinite(search.bound) else []
    status = "heuristic"
    if search.exact:
        status = "Optimal"
    left = time_limit_s - (time.perf_counter() - started)
    if run_highs and left > HIGHS_MIN_S:
        warm = min(candidates, key=lambda c: c[0].objective)[1] if candidates else None
        milp = solve_milp(instance, time_limit_s=left, mip_gap=gap, warm_start=warm, isolate=True)
        detail.update(highs_objective=milp.objective, highs_bound=_finite(milp.bound), milp_cols=milp.n_cols)
        if milp.evaluation is not None and milp.evaluation.feasible:
            candidates.append((milp.evaluation, milp.solution, "milp"))
        if math.isfinite(milp.bound):
            bounds.append(milp.bound)
        if milp.status == "Infeasible" and not candidates:
            raise _infeasible(instance, "the MILP proved that no plan fits")
        if milp.status == "Optimal":
            status = "Optimal"
    if not candidates:
        raise _infeasible(instance, "no feasible plan with a precision per layer was found")
    evaluation, solution, source = min(candidates, key=lambda c: c[0].objective)
    detail["plan_from"] = source
    bound = max(bounds) if bounds else None
    proven = _gap(evaluation.objective, bound) if bound is not None else None
    if status != "Optimal" and proven is not None and proven <= gap:
        status = "gap reached"
    return PlanResult(
        solution, evaluation, "milp", status, proven, bound, time.perf_counter() - started, detail
    )


def _budget_error(instance: PlanningInstance) -> TesselError | None:
    """When a quality budget is why no plan was found: the error naming the smallest feasible one."""
    choice = instance.precision
    if choice is None or not math.isfinite(choice.quality_budget):
        return None
    from tessel.plan.solvers.precision_search import smallest_feasible_budget

    least, proven = smallest_feasible_budget(instance)
    if not math.isfinite(least) or least <= choice.quality_budget * (1 + 1e-6):
        return None
    return TesselError(
        f"no plan meets the quality budget {choice.quality_budget:.4g}: the smallest budget with a plan is "
        f"{least:.4g} (proven >= {proven:.4g}); raise --quality-budget to at least that, or add GPUs"
    )


def _gap(objective: float, bound: float) -> float:
    if not math.isfinite(bound):
        return math.inf
    return max(objective - bound, 0.0) / objective if objective else 0.0


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _infeasible(instance: PlanningInstance, what: str) -> TesselError:
    from tessel.plan.build import capacity_shortfall_bytes

    shortfall = capacity_shortfall_bytes(instance)
    if shortfall > 0:
        return TesselError(
            f"the model does not fit: it needs {shortfall / GIB:.1f} GiB more than the cluster's GPU "
            "and host "
            "memory together; add GPUs or host memory, or use a smaller dtype / shorter workload"
        )
    need = (
        float(instance.weight_bytes.sum() + instance.kv_bytes.sum())
        + instance.first_bytes
        + instance.last_bytes
    )
    gpu = sum(d.memory_bytes for d in instance.devices)
    extra = max(need + float(instance.workspace_bytes.min()) - gpu, 0.0)
    hidden = instance.swap_in == "hidden"
    rules = ", offloading and swap-in rules" if hidden else " and offloading rules"
    why = (
        " (with --swap-in hidden the first stage may not offload, and offloaded bytes must stream in "
        "under the upstream stage; --swap-in charged lifts that)"
        if hidden
        else ""
    )
    hint = f" (it needs {extra / GIB:.1f} GiB more GPU memory to avoid offloading)" if extra > 0 else ""
    return TesselError(
        f"{what}: the model's {need / GIB:.1f} GiB of weights and KV cannot be placed on "
        f"{instance.n_devices} devices with {gpu / GIB:.1f} GiB of GPU memory under the memory"
        f"{rules}{hint}; add GPUs, or lower max_micro_batch or the lengths in the workload{why}"
    )
