"""The CPP chunk planner: where to cut long prompts so that chunks flow through the stages with few bubbles.

Three steps, on the token grid of `tessel.chunk.grid`:

1. **TeraPipe DP.** With M_i = max_s t_s(chunk i) and U_i = max_{s>0} (send_{s-1} + t_s)(chunk i),
   every chunking's makespan is at most `sum_i M_i + (S-1) * max_i U_i`, with equality for a
   *uniform* pipeline (all stages the same chunk times, all links the same send times), where it
   is TeraPipe's `sum t + (S-1) max t`. For a bound tau, F_tau(j) = min_k { F_tau(j-k) + M(k, j) :
   U(k, j) <= tau } (one O(n * W) pass, vectorised over a batch of taus), and the answer is
   min_tau F_tau(N) + (S-1) * tau. The bound only matters at the distinct values of U, and
   F_tau is non-increasing in tau, so for evaluated taus a < b no tau in (a, b) beats
   F_b(N) + (S-1) * (next value after a): intervals are refined (bisection over the sorted
   distinct values, many per pass) until every interval is evaluated or pruned. The result is
   the exact minimiser of the bound over all grid chunkings: optimal for uniform pipelines.
2. **Local and beam search** (non-uniform pipelines, `local_search=True`): from the best DP
   candidates (and any `seeds`, e.g. the baselines) by true makespan, steepest descent over
   boundary shifts (1, 2, 4, ... grid steps), merges and splits, every candidate scored with the
   exact flow-shop recurrence (bounded by a work budget); then a beam search over the states of
   step 3 (16 to 64 per boundary, more on shorter grids), polished by the same local search.
   Unequal stages want chunks that grow while the pipeline fills and shrink while it drains,
   which the bound of step 1 cannot express and the beam finds.
3. **Exact search** (non-uniform, small grids: `exact=None` runs it up to 64 grid steps): a DP
   over grid boundaries whose state is the vector of stage finish times of the last chunk,
   keeping only Pareto-minimal states and pruning by a lower bound against the incumbent. The
   recurrence is monotone in that vector, so this is exact; it gives up (and says so) past
   `max_exact_states` states.

A plan carries `optimal=True` only when one of the exact arguments applies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tessel.chunk.grid import TokenGrid, make_grid, stage_tables, surrogate_tables
from tessel.chunk.latency import PipelineLatency
from tessel.chunk.schedule import (
    Schedule,
    evaluate_chunks,
    flow_shop_finish,
    stage_prefill_times,
    stage_send_times,
)
from tessel.errors import TesselError

TAU_BATCH = 32  # taus per vectorised DP pass
EXACT_MAX_GRID = 64  # largest grid (steps) the exact Pareto search runs on by default
EXACT_MAX_STATES = 300_000  # Pareto states over all boundaries before the exact search gives up
LOCAL_SEARCH_ROUNDS = 40  # steepest-descent rounds (each scores every neighbour at once)
LOCAL_SEARCH_CELLS = 3e7  # scored (candidate x chunk x stage) cells per local search
LOCAL_SEARCH_MULTI_START_GRID = 256  # up to this many grid steps, start from the 3 best DP plans
BEAM_STATES = 40_000  # finish-time states the beam search keeps over all grid boundaries ...
BEAM_WIDTH_RANGE = (16, 64)  # ... as a per-boundary beam width within this range
REL_EPS = 1e-12  # relative slack for float comparisons of makespans
# Size limits of one problem. The DP tables hold (grid steps) x (steps per chunk) cells per stage,
# so memory grows with the square of the steps: 4096 steps (a 256K-token prompt on the 64-token
# grid) fit a 2-core dev machine, twice that does not (measured: docs/results.md, Limits). Longer
# prompts want a coarser grid or a chunk-size cap.
MAX_GRID_STEPS = 4096
MAX_PROMPT_TOKENS = 2**24  # 16.8M tokens: above any model's context window


@dataclass(frozen=True, slots=True)
class ChunkProblem:
    """One prefill (or a batch of them, run request after request) on a pipeline."""

    pipeline: PipelineLatency
    seq_lens: tuple[int, ...]
    grid_tokens: int = 64
    max_chunk_tokens: int | None = None
    tail_s: float = 0.0  # after the last chunk leaves the last stage (LM head of the last token)
    # Seq1F1B's equal-FLOP baseline: matmul FLOPs per token / attention FLOPs per (query, key) pair
    flops_linear_tokens: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "seq_lens", tuple(int(n) for n in self.seq_lens))
        check_problem_size(self.seq_lens, self.grid_tokens, self.max_chunk_tokens)


def check_problem_size(seq_lens: Sequence[int], grid_tokens: int, max_chunk_tokens: int | None) -> None:
    """Refuse problems the planner cannot hold in memory or finish in reasonable time."""
    if not seq_lens or min(seq_lens) < 1 or max(seq_lens) > MAX_PROMPT_TOKENS:
        raise TesselError(
            f"prompt lengths must be positive and at most {MAX_PROMPT_TOKENS} tokens, got {_brief(seq_lens)}"
        )
    if not 1 <= grid_tokens <= MAX_PROMPT_TOKENS:
        raise TesselError(
            f"the grid must be positive and at most {MAX_PROMPT_TOKENS} tokens, got {grid_tokens}"
        )
    if max_chunk_tokens is not None and not 1 <= max_chunk_tokens <= MAX_PROMPT_TOKENS:
        raise TesselError(
            f"max chunk tokens must be positive and at most {MAX_PROMPT_TOKENS}, got {max_chunk_tokens}"
        )
    steps = sum(-(-length // grid_tokens) for length in seq_lens)
    if steps > MAX_GRID_STEPS:
        coarser = -(-sum(seq_lens) // MAX_GRID_STEPS)
        raise TesselError(
            f"{sum(seq_lens)} prompt tokens on a {grid_tokens}-token grid are {steps} grid steps; the chunk "
            f"planner takes at most {MAX_GRID_STEPS} (memory grows with their square): use a grid of "
            f"at least {coarser} tokens, or fewer tokens"
        )


def _brief(values: Sequence[int], limit: int = 8) -> str:
    text = ", ".join(str(v) for v in list(values)[:limit])
    return f"[{text}{', ...' if len(values) > limit else ''}]"


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    schedule: Schedule
    method: str
    optimal: bool  # proven optimal over all chunkings on the grid
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def chunks(self) -> tuple[int, ...]:
        return self.schedule.chunks

    @property
    def ttft_s(self) -> float:
        return self.schedule.ttft_s

    @property
    def bubble_fraction(self) -> float:
        return self.schedule.bubble_fraction


class _Scorer:
    """Exact makespans of many chunkings (as boundary-index arrays) at once."""

    def __init__(self, grid: TokenGrid, pipeline: PipelineLatency) -> None:
        self.grid, self.pipeline = grid, pipeline

    def valid(self, bounds: np.ndarray) -> np.ndarray:
        ends = bounds[..., 1:]
        return ((bounds[..., :-1] >= self.grid.first[ends]) & (bounds[..., :-1] < ends)).all(axis=-1)

    def makespans(self, bounds: np.ndarray) -> np.ndarray:
        """[R, K+1] boundary indices -> [R] makespans."""
        pos = self.grid.positions
        c = pos[bounds[:, 1:]] - pos[bounds[:, :-1]]
        p = pos[bounds[:, :-1]] - self.grid.request_start[bounds[:, 1:]]
        stages = self.pipeline.stages
        times = np.stack([stage_prefill_times(stage, c, p) for stage in stages], axis=1)
        sends = np.zeros_like(times)
        for s in range(len(stages) - 1):
            sends[:, s] = stage_send_times(stages[s], c)
        return flow_shop_finish(times, sends)[:, -1, -1]


def plan_chunks(
    problem: ChunkProblem,
    *,
    exact: bool | None = None,
    max_exact_states: int = EXACT_MAX_STATES,
    local_search: bool = True,
    seeds: Sequence[Sequence[int]] = (),
) -> ChunkPlan:
    """The best chunking found (see the module docstring for what is guaranteed).

    `exact`: None runs the exact search on non-uniform pipelines of at most `EXACT_MAX_GRID` grid
    steps; True runs it at any size and on uniform pipelines too (a cross-check of the DP), bounded
    by `max_exact_states`; False never. `local_search`: the local and beam searches on
    non-uniform pipelines. `seeds`: more chunkings (token counts, e.g. the baselines') to start
    from; those on the grid compete with the DP's candidates, so the plan is never worse than them.
    """
    grid = make_grid(problem.seq_lens, problem.grid_tokens, problem.max_chunk_tokens)
    pipeline = problem.pipeline
    m_table, u_table, uniform = surrogate_tables(grid, pipeline)
    candidates = terapipe_candidates(grid, m_table, u_table, pipeline.n_stages)
    scorer = _Scorer(grid, pipeline)
    notes = [f"TeraPipe DP: {len(candidates)} candidate chunkings"]
    scalar = [i for i, stage in enumerate(pipeline.stages) if not hasattr(stage, "prefill_times_s")]
    if scalar:
        notes.append(f"stages {scalar} have no vectorised prefill_times_s: one Python call per (c, p) pair")
    ranked = _rank(scorer, candidates + _on_grid(grid, seeds))
    best_value, best_bounds = ranked[0]
    if best_bounds not in candidates:
        notes.append("a seed chunking beat the DP's")
    optimal = uniform
    method = "terapipe-dp"
    if not uniform and local_search:
        for _, start in ranked[: 3 if grid.n <= LOCAL_SEARCH_MULTI_START_GRID else 1]:
            bounds, value = _local_search(scorer, grid, start)
            if value < best_value * (1 - REL_EPS):
                best_bounds, best_value, method = bounds, value, "terapipe-dp+local-search"
        bounds, value = _beam_search(scorer, grid, pipeline, best_bounds, best_value)
        if value < best_value * (1 - REL_EPS):
            best_bounds, best_value, method = bounds, value, "terapipe-dp+beam-search"
    if exact or (exact is None and not uniform and grid.n <= EXACT_MAX_GRID):
        found = _pareto_exact(grid, pipeline, best_value, max_exact_states)
        if found is None:
            notes.append(f"exact search gave up after {max_exact_states} states")
        else:
            optimal = True
            if found[1] < best_value * (1 - REL_EPS):
                best_bounds, best_value, method = found[0], found[1], "exact-pareto-dp"
            notes.append("exact Pareto search proved the plan optimal")
    schedule = evaluate_chunks(pipeline, grid.chunks_from_bounds(best_bounds), grid.seq_lens, problem.tail_s)
    return ChunkPlan(schedule, method, optimal, tuple(notes))


def _on_grid(grid: TokenGrid, seeds: Sequence[Sequence[int]]) -> list[list[int]]:
    """Seed chunkings as boundary indices, keeping those on the grid that respect its caps."""
    out = []
    for chunks in seeds:
        try:
            bounds = grid.bounds_from_chunks(chunks)
        except ValueError:
            continue
        if bounds[-1] == grid.n and all(grid.valid(i, j) for i, j in zip(bounds, bounds[1:], strict=False)):
            out.append(bounds)
    return out


def _beam_search(
    scorer: _Scorer, grid: TokenGrid, pipeline: PipelineLatency, bounds: list[int], value: float
) -> tuple[list[int], float]:
    """Beam search over finish-time states (chunks up to twice the incumbent's largest), polished
    by local search; returns the incumbent when it finds nothing better."""
    widest = int(np.diff(bounds).max())
    beam = int(np.clip(BEAM_STATES // grid.n, *BEAM_WIDTH_RANGE))
    found = _pareto_exact(
        grid, pipeline, value, max_states=grid.n * beam + 1, beam=beam, max_width=2 * widest
    )
    if found is None or not found[0]:
        return bounds, value
    return _local_search(scorer, grid, found[0])


def _rank(scorer: _Scorer, candidates: Sequence[list[int]]) -> list[tuple[float, list[int]]]:
    """Distinct chunkings with their exact makespans, best first (scored in batches of equal length)."""
    by_len: dict[int, list[list[int]]] = {}
    seen: set[tuple[int, ...]] = set()
    for bounds in candidates:
        if tuple(bounds) not in seen:
            seen.add(tuple(bounds))
            by_len.setdefault(len(bounds), []).append(bounds)
    scored = []
    for group in by_len.values():
        scored += list(zip(scorer.makespans(np.asarray(group)).tolist(), group, strict=True))
    scored.sort(key=lambda item: item[0])
    return scored


# ---------------------------------------------------------------------------------------------
# TeraPipe DP over the bound tau


def _dp_batch(
    m_table: np.ndarray, u_table: np.ndarray, first: np.ndarray, taus: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """F_tau(j) for each tau (rows) and the argmin start boundary; inf where no chunking fits."""
    n = m_table.shape[0] - 1
    n_tau = len(taus)
    best = np.full((n_tau, n + 1), np.inf)
    best[:, 0] = 0.0
    arg = np.zeros((n_tau, n + 1), dtype=np.int64)
    bound = taus[:, None]
    rows = np.arange(n_tau)
    allowed = u_table <= taus.max()
    # columns past the last allowed one never matter for this batch
    last = np.where(allowed.any(axis=1), allowed.shape[1] - np.argmax(allowed[:, ::-1], axis=1), 0)
    for j in range(1, n + 1):
        width = min(int(last[j]), j - int(first[j]))
        if width == 0:
            continue
        prev = best[:, j - width : j][:, ::-1]  # F(j-1), ..., F(j-width)
        total = prev + m_table[j, :width]
        total[u_table[j, :width] > bound] = np.inf
        k = np.argmin(total, axis=1)
        best[:, j] = total[rows, k]
        arg[:, j] = j - 1 - k
    return best, arg


def _minimax(u_table: np.ndarray, first: np.ndarray) -> float:
    """min over chunkings of max_i U_i (the smallest feasible tau)."""
    n = u_table.shape[0] - 1
    worst = np.full(n + 1, np.inf)
    worst[0] = 0.0
    for j in range(1, n + 1):
        width = j - int(first[j])
        worst[j] = np.min(np.maximum(worst[j - width : j][::-1], u_table[j, :width]))
    return float(worst[n])


def _backtrack(arg: np.ndarray, n: int) -> list[int]:
    bounds = [n]
    while bounds[-1] > 0:
        bounds.append(int(arg[bounds[-1]]))
    return bounds[::-1]


def terapipe_candidates(
    grid: TokenGrid, m_table: np.ndarray, u_table: np.ndarray, n_stages: int
) -> list[list[int]]:
    """Chunkings (boundary indices) of the DP at every tau that bisection did not prune; the first
    one minimises `sum M + (S-1) max U` over all grid chunkings."""
    n, first = grid.n, grid.first
    unconstrained_f, unconstrained_arg = _dp_batch(m_table, u_table, first, np.array([np.inf]))
    f_min = float(unconstrained_f[0, n])
    base = _backtrack(unconstrained_arg[0], n)
    if n_stages == 1:
        return [base]
    weight = n_stages - 1
    tau_lo = _minimax(u_table, first)
    tau_hi = _max_u(u_table, base)
    values = u_table[np.isfinite(u_table) & (u_table >= tau_lo) & (u_table <= tau_hi)]
    values = np.unique(values)
    solutions: dict[int, tuple[float, list[int]]] = {}  # value index -> (F, chunking)
    best = f_min + weight * tau_hi  # the unconstrained chunking's objective

    def evaluate(indices: list[int]) -> None:
        nonlocal best
        taus = values[np.asarray(indices)]
        f, arg = _dp_batch(m_table, u_table, first, taus)
        for row, index in enumerate(indices):
            bounds = _backtrack(arg[row], n) if np.isfinite(f[row, n]) else []
            solutions[index] = (float(f[row, n]), bounds)
            if bounds:
                best = min(best, float(f[row, n]) + weight * _max_u(u_table, bounds))

    start = np.unique(np.linspace(0, len(values) - 1, min(TAU_BATCH, len(values))).round().astype(int))
    evaluate(start.tolist())
    while True:
        # values above this can't win: F >= f_min
        limit = np.searchsorted(values, (best - f_min) / weight, side="right")
        evaluated = sorted(solutions)
        open_intervals = []
        for a, b in zip(evaluated, evaluated[1:], strict=False):
            if b - a <= 1 or a + 1 >= limit:
                continue
            lower = solutions[b][0] + weight * values[a + 1]
            if lower < best * (1 - REL_EPS):
                open_intervals.append((a, min(b, limit + 1)))
        if not open_intervals:
            break
        per = max(1, TAU_BATCH // len(open_intervals))
        picks: list[int] = []
        for a, b in open_intervals:
            inner = np.linspace(a, b, per + 2)[1:-1].round().astype(int)
            picks += [int(i) for i in np.unique(inner) if a < i < b and int(i) not in solutions]
        if not picks:
            break
        for at in range(0, len(picks), TAU_BATCH):
            evaluate(picks[at : at + TAU_BATCH])
    ranked = sorted(
        (f + weight * _max_u(u_table, bounds), bounds) for f, bounds in solutions.values() if bounds
    )
    ranked.append((best + 1.0, base))
    return [bounds for _, bounds in ranked]


def _max_u(u_table: np.ndarray, bounds: Sequence[int]) -> float:
    b = np.asarray(bounds)
    return float(u_table[b[1:], b[1:] - b[:-1] - 1].max())


# ---------------------------------------------------------------------------------------------
# Local search with exact scoring


def _neighbours(grid: TokenGrid, bounds: list[int], wide: bool = True) -> list[list[int]]:
    """Boundary shifts (by 1, 2, 4, ... grid steps; only 1 when not `wide`), merges and splits."""
    out = []
    n_bounds = len(bounds)
    for at in range(1, n_bounds - 1):
        if grid.fixed[bounds[at]]:
            continue
        lo, hi = bounds[at - 1], bounds[at + 1]
        step = 1
        while step < hi - lo and (wide or step == 1):
            for moved in (bounds[at] - step, bounds[at] + step):
                if lo < moved < hi:
                    out.append(bounds[:at] + [moved] + bounds[at + 1 :])
            step *= 2
        out.append(bounds[:at] + bounds[at + 1 :])  # merge the two chunks around it
    for at in range(n_bounds - 1):  # split a chunk
        lo, hi = bounds[at], bounds[at + 1]
        cuts = (
            {lo + (hi - lo) // 2, lo + (hi - lo) // 4, hi - (hi - lo) // 4, lo + 1, hi - 1}
            if wide
            else {lo + (hi - lo) // 2}
        )
        for cut in cuts:
            if lo < cut < hi:
                out.append(bounds[: at + 1] + [cut] + bounds[at + 1 :])
    return out


def _local_search(
    scorer: _Scorer, grid: TokenGrid, bounds: list[int], budget_cells: float = LOCAL_SEARCH_CELLS
) -> tuple[list[int], float]:
    """Steepest descent; stops at a local optimum, after LOCAL_SEARCH_ROUNDS rounds, or when the
    (candidates x chunks x stages) cells it has scored reach `budget_cells` (a narrower
    neighbourhood is tried first when the full one does not fit)."""
    value = float(scorer.makespans(np.asarray([bounds]))[0])
    n_stages = scorer.pipeline.n_stages
    used = 0.0
    for _ in range(LOCAL_SEARCH_ROUNDS):
        candidates = _neighbours(grid, bounds)
        if used + len(candidates) * len(bounds) * n_stages > budget_cells:
            candidates = _neighbours(grid, bounds, wide=False)
            if used + len(candidates) * len(bounds) * n_stages > budget_cells:
                break
        used += len(candidates) * len(bounds) * n_stages
        by_len: dict[int, list[list[int]]] = {}
        for candidate in candidates:
            by_len.setdefault(len(candidate), []).append(candidate)
        best_here, best_bounds = value, None
        for group in by_len.values():
            array = np.asarray(group)
            ok = scorer.valid(array)
            if not ok.any():
                continue
            array = array[ok]
            values = scorer.makespans(array)
            k = int(np.argmin(values))
            if values[k] < best_here * (1 - REL_EPS):
                best_here, best_bounds = float(values[k]), array[k].tolist()
        if best_bounds is None:
            break
        bounds, value = best_bounds, best_here
    return bounds, value


# ---------------------------------------------------------------------------------------------
# Exact search: Pareto-minimal finish-time vectors per boundary


def _pareto_exact(
    grid: TokenGrid,
    pipeline: PipelineLatency,
    incumbent: float,
    max_states: int,
    beam: int | None = None,
    max_width: int | None = None,
) -> tuple[list[int], float] | None:
    """The optimal chunking and its makespan, or None when the state budget runs out.

    With `beam`, only the `beam` states of lowest lower bound survive at each boundary and chunks
    span at most `max_width` grid steps: a heuristic (beam search over the same states), not exact.

    State at boundary i: C = (C_1..C_S), the finish times of the last chunk on every stage.
    A new chunk maps it to C'_1 = C_1 + t_1, C'_s = max(C_s, C'_{s-1} + send_{s-1}) + t_s, which is
    non-decreasing in every component of C, so a state dominated componentwise by another at the
    same boundary can never lead to a better makespan and is dropped. A state whose lower bound
    max_s (C_s + least remaining work of stage s + least drain after s) exceeds the incumbent is
    dropped too. States are stored flat in boundary order, so the states a chunk ending at j can
    extend (boundaries first[j]..j-1) are one contiguous slice.
    """
    n, n_stages = grid.n, pipeline.n_stages
    times, sends = stage_tables(grid, pipeline, max_width)  # [S, n+1, W]
    width = times.shape[2]
    rest = np.stack([_suffix_min_sum(times[s]) for s in range(n_stages)])  # [S, n+1]
    drain = _drain(times, sends, n)
    limit = incumbent * (1 + 1e-9)
    states = np.zeros((max_states + 1, n_stages))
    where = np.zeros(max_states + 1, dtype=np.int64)  # boundary of each state
    parent = np.full(max_states + 1, -1, dtype=np.int64)
    begin = np.zeros(n + 2, dtype=np.int64)  # states of boundary j: begin[j]..begin[j+1]
    count = 1
    begin[1] = 1
    for j in range(1, n + 1):
        lo, hi = begin[max(int(grid.first[j]), j - width)], count
        if hi > lo:
            prev, col = states[lo:hi], j - 1 - where[lo:hi]
            t, snd = times[:, j, col], sends[:, j, col]  # [S, states]
            cur = np.empty_like(prev)
            cur[:, 0] = prev[:, 0] + t[0]
            for s in range(1, n_stages):
                cur[:, s] = np.maximum(prev[:, s], cur[:, s - 1] + snd[s - 1]) + t[s]
            lower = (cur + rest[:, j] + (drain if j < n else 0.0)).max(axis=1)
            keep = np.flatnonzero(lower <= limit)
            if beam is not None and len(keep) > 4 * beam:  # beam: only the most promising are compared
                keep = keep[np.argsort(lower[keep], kind="stable")[: 4 * beam]]
            keep = keep[_pareto_minimal(cur[keep])]
            if beam is not None and len(keep) > beam:
                keep = keep[np.argsort(lower[keep], kind="stable")[:beam]]
            if count + len(keep) > max_states:
                return None
            states[count : count + len(keep)] = cur[keep]
            where[count : count + len(keep)] = j
            parent[count : count + len(keep)] = lo + keep
            count += len(keep)
        begin[j + 1] = count
    final = np.arange(begin[n], begin[n + 1])
    if len(final) == 0:
        return [], np.inf  # nothing beat the incumbent: it is optimal
    index = int(final[np.argmin(states[final, -1])])
    value = float(states[index, -1])
    bounds = []
    while index >= 0:
        bounds.append(int(where[index]))
        index = int(parent[index])
    return bounds[::-1], value


def _suffix_min_sum(table: np.ndarray) -> np.ndarray:
    """R(i): least sum of one stage's chunk times over chunkings of boundaries i..n (band table)."""
    n, width = table.shape[0] - 1, table.shape[1]
    jj, kk = np.nonzero(np.isfinite(table))
    by_start = np.full((n + 1, width), np.inf)  # row i, column k: chunk (i, i+k+1)
    by_start[jj - kk - 1, kk] = table[jj, kk]
    rest = np.full(n + width + 1, np.inf)
    rest[n] = 0.0
    for i in range(n - 1, -1, -1):
        rest[i] = np.min(by_start[i] + rest[i + 1 : i + 1 + width])
    return rest[: n + 1]


def _drain(times: np.ndarray, sends: np.ndarray, n: int) -> np.ndarray:
    """Least time from stage s finishing the last chunk to it leaving the last stage, per s."""
    n_stages = times.shape[0]
    after = np.zeros((n_stages, times.shape[2]))
    for s in range(n_stages - 2, -1, -1):
        after[s] = after[s + 1] + sends[s, n] + times[s + 1, n]
    return np.where(np.isfinite(after), after, np.inf).min(axis=1)


PARETO_PIVOTS = 64  # states checked against every candidate when there are too many for all pairs
PARETO_ALL_PAIRS = 1500


def _pareto_minimal(states: np.ndarray) -> np.ndarray:
    """Indices of the states to keep: every state dominated componentwise by another is dropped
    when there are few; with many, only those dominated by one of the best pivots (still exact:
    keeping a dominated state costs time, never optimality). Ties keep the first."""
    m = len(states)
    if m <= 1:
        return np.arange(m)
    order = np.lexsort(states.T[::-1])  # a dominating state sorts before the states it dominates
    ranked = states[order]
    survivors = np.arange(m)
    if m > PARETO_ALL_PAIRS:
        pivots = ranked[np.argsort(ranked.sum(axis=1))[:PARETO_PIVOTS]]
        le = (pivots[:, None, :] <= ranked[None, :, :]).all(axis=2)
        lt = (pivots[:, None, :] < ranked[None, :, :]).any(axis=2)
        survivors = np.flatnonzero(~(le & lt).any(axis=0))
    if len(survivors) <= PARETO_ALL_PAIRS:
        rest = ranked[survivors]
        le = (rest[:, None, :] <= rest[None, :, :]).all(axis=2)  # le[a, b]: a dominates or ties b
        survivors = survivors[~np.triu(le, k=1).any(axis=0)]
    return order[survivors]


def plan_for(
    pipeline: PipelineLatency,
    seq_len: int | Sequence[int],
    grid_tokens: int = 64,
    max_chunk_tokens: int | None = None,
    tail_s: float = 0.0,
) -> ChunkPlan:
    """Shortcut: plan one prompt (an int) or a batch (a list of prompt lengths)."""
    lens = (seq_len,) if isinstance(seq_len, int) else tuple(seq_len)
    return plan_chunks(ChunkProblem(pipeline, lens, grid_tokens, max_chunk_tokens, tail_s))


__all__ = ["ChunkPlan", "ChunkProblem", "make_grid", "plan_chunks", "plan_for", "terapipe_candidates"]
