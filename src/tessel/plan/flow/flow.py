"""Flow over layer placements (Helix's idea): each GPU holds one contiguous range of units, and
requests are routed over the graph of placements instead of down disjoint pipelines.

The placement graph has a node per used device; an edge j -> k wherever j's range ends where k's
starts, a source edge into every device whose range starts at unit 0 and a sink edge out of every
device whose range ends at the last unit. A request follows one source-sink path, so a path is a
pipeline whose devices may be shared with other paths.

Cost model of a flow plan (`evaluate_flow`), the pipeline model of `tessel.plan.solution` with
devices shared by time: path p keeps k_p micro-batches of b requests in flight; device j gives a
share phi_jp of its time to path p (sum_p phi_jp = 1, in proportion to the work the routed rates
bring it). With T_j its stage time on the path (prefill or decode, its send to the path's next
device included, as `evaluate` prices them), the path is the pipeline formula with k_p micro-batches
whose first micro-batch crosses at full speed and whose bottleneck delivers at its share,

    P_p = max(sum_j T^pre_j + (k_p - 1) M^pre_p, k_p M^pre_p),   M_p = max_j T_j / phi_jp
    D_p = the same for decode,      X_p = k_p b n_out / (P_p + n_out D_p),

capped by the queueing the shares leave out (`queueing_rates`): a path's micro-batches wait at a
shared device for the ones other paths put there first, which the shares' formula counts only where
one device is the bottleneck (with k_p = 1 it says sum_j T_j, no wait at all). Mean value analysis of
the closed network of the paths' circulating micro-batches (first come first served, fixed service
times) gives each path's rate X^q_p; X_p = min(the formula above, X^q_p), so a path alone on its
devices keeps the pipeline formula (alone, the queueing rate is not below it), and the plan's
throughput is sum_p X_p (routing weights X_p / sum X). Without the cap, a plan of many long paths
sharing GPUs was priced above what `tessel simulate` serves in steady state, and routing by those
rates sent the slowest paths too many requests (they drained last).

A finite batch all at once (`batch_throughput_tok_s`) ends with its last path: routing rounds each
path's share to whole requests, and a path given fewer than one micro-batch still takes a full pass
per token; `throughput_tok_s` is the steady state.

Every device holds its range's weights (and the embedding / LM head where its range starts at 0 /
ends at the last unit), its workspace and the KV of every micro-batch of every path through it,
all in GPU memory (concurrency by memory, no offloading): sum_p k_p kv_j <= free_j. The k_p are
chosen greedily by the formula's marginal throughput (each X_p is concave in k_p), at most
`max_micro_batches` in all when given. Disjoint paths (phi = 1) are priced exactly as
`tessel.plan.replicas.replicas` prices replicas by memory, so a replica plan is a flow plan with the same
throughput (`from_pipelines`).

So X_p <= phi_jp / W_j on every device of the path (W_j = T^pre_j + n_out T^dec_j): no device is
busy more than all its time. The bound of `tessel.plan.solvers.memory_bound` holds for these plans too (busy
time, Little's law X_p sum_j W_j <= k_p, memory). Links are charged as the sender's stage time
(the additive form), which caps each edge's rate at 1 / its send time; a node's network interface
shared by several senders is not modelled.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from tessel.errors import TesselError
from tessel.plan.files.workload import MAX_MICRO_BATCHES
from tessel.plan.instance import PlanningInstance, gpu_memory_only, with_micro_batches
from tessel.plan.replicas.weighted_turns import dealt_counts
from tessel.plan.solution import FEASIBILITY_ATOL_BYTES, FEASIBILITY_RTOL, Solution, Stage, evaluate
from tessel.plan.steady_state import steady_state_tok_s

SOURCE, SINK = -1, -2  # graph ends in edge lists
FLOW_EPS = 1e-12  # rates below this are no flow
SHARE_ROUNDS = 3  # time shares recomputed from the allocated rates this many times
QUEUE_ITERATIONS = 400  # mean value analysis fixed-point steps (`queueing_rates`), at most
QUEUE_RTOL = 1e-7


@dataclass(frozen=True, slots=True)
class FlowPath:
    devices: tuple[int, ...]  # in path order; their ranges tile the units
    micro_batches: int  # k_p in flight
    throughput_tok_s: float
    weight: float  # share of the requests routed to it (sums to 1 over the paths)
    ttft_s: float  # prefill makespan of its k_p micro-batches, shared stage times
    tpot_s: float  # decode makespan
    time_shares: tuple[float, ...] = ()  # per device: the share of its time this path gets
    # the prediction without the fill per round (`tessel.plan.steady_state.steady_state_tok_s`), capped by
    # the queueing where the path shares a device; None: not priced
    steady_state_tok_s: float | None = None


@dataclass(frozen=True, slots=True)
class FlowPlan:
    stages: tuple[Stage, ...]  # each used device's range (one per device), sorted by unit_start
    paths: tuple[FlowPath, ...]
    throughput_tok_s: float

    def stage_of(self, device: int) -> Stage:
        return next(s for s in self.stages if s.device == device)

    def edge_weights(self) -> dict[tuple[int, int], float]:
        """Share of all requests on each edge (SOURCE / SINK at the ends): the flow weights."""
        out: dict[tuple[int, int], float] = defaultdict(float)
        for path in self.paths:
            hops = (SOURCE, *path.devices, SINK)
            for a, b in zip(hops, hops[1:], strict=False):
                out[(a, b)] += path.weight
        return dict(out)

    @property
    def micro_batches(self) -> int:
        return sum(p.micro_batches for p in self.paths)

    @property
    def shared(self) -> bool:
        """Whether some device serves several paths (not expressible as disjoint pipelines)."""
        seen = [d for p in self.paths for d in p.devices]
        return len(seen) != len(set(seen))


def check_placements(instance: PlanningInstance, stages: tuple[Stage, ...] | list[Stage]) -> None:
    """Refuse placements whose graph has no path from the first unit to the last, naming the
    layer range no path crosses."""
    n = instance.n_units
    reach = reachable_boundaries(stages, n)
    if n in reach:
        return
    held = np.zeros(n, dtype=bool)
    for s in stages:
        held[s.unit_start : s.unit_end] = True
    first = max(reach)
    if not held[first]:
        last = first
        while last + 1 < n and not held[last + 1]:
            last += 1
        why = "no GPU holds"
    else:
        last = n - 1
        why = "no chain of GPU ranges reaches from layer 0 through"
    a, b = instance.units[first].layer, instance.units[last].layer
    span = f"layer {a}" if a == b else f"layers {a}-{b}"
    raise TesselError(
        f"the placement graph has no path from the first layer to the last: {why} {span} "
        f"(ranges must meet: one GPU's range ends where the next one's starts)"
    )


def reachable_boundaries(stages, n_units: int) -> set[int]:
    """Unit boundaries a request can reach from unit 0 following ranges that meet."""
    starts: dict[int, list[int]] = defaultdict(list)
    for s in stages:
        starts[s.unit_start].append(s.unit_end)
    reach, todo = {0}, [0]
    while todo:
        at = todo.pop()
        for end in starts.get(at, ()):
            if end not in reach and end <= n_units:
                reach.add(end)
                todo.append(end)
    return reach


def placement_edges(stages, n_units: int) -> list[tuple[int, int]]:
    """Edges of the placement graph (device indices; SOURCE / SINK at the ends)."""
    by_start: dict[int, list[int]] = defaultdict(list)
    for s in stages:
        by_start[s.unit_start].append(s.device)
    edges = [(SOURCE, d) for d in by_start.get(0, ())]
    for s in stages:
        if s.unit_end == n_units:
            edges.append((s.device, SINK))
        else:
            edges += [(s.device, d) for d in by_start.get(s.unit_end, ())]
    return edges


def max_flow(
    edges: list[tuple[int, int]], node_capacity: dict[int, float], edge_capacity=None
) -> tuple[float, dict[tuple[int, int], float]]:
    """Max flow SOURCE -> SINK over `edges` with capacities on the nodes (and optionally edges),
    by shortest augmenting paths on the node-split graph. Returns (value, flow per edge)."""
    edge_capacity = edge_capacity or {}
    # node-split: v_in = ("i", v), v_out = ("o", v); an edge (a, b) goes a_out -> b_in
    cap: dict = defaultdict(float)
    adj: dict = defaultdict(dict)  # an ordered set: the same augmenting paths in every process

    def arc(a, b, c):
        cap[(a, b)] += c
        adj[a][b] = None
        adj[b][a] = None

    for v, c in node_capacity.items():
        arc(("i", v), ("o", v), max(c, 0.0))
    for a, b in edges:
        tail = ("o", a) if a != SOURCE else "s"
        head = ("i", b) if b != SINK else "t"
        arc(tail, head, edge_capacity.get((a, b), math.inf))
    flow: dict = defaultdict(float)
    total = 0.0
    while True:
        parent = {"s": None}
        queue = ["s"]
        for u in queue:
            if "t" in parent:
                break
            for v in adj[u]:
                if v not in parent and cap[(u, v)] - flow[(u, v)] > FLOW_EPS:
                    parent[v] = u
                    queue.append(v)
        if "t" not in parent:
            break
        path, v = [], "t"
        while parent[v] is not None:
            path.append((parent[v], v))
            v = parent[v]
        push = min(cap[e] - flow[e] for e in path)
        if not math.isfinite(push):
            raise ValueError("unbounded flow: a path without capacity")
        for u, v in path:
            flow[(u, v)] += push
            flow[(v, u)] -= push
        total += push
    out = {}
    for a, b in edges:
        tail = ("o", a) if a != SOURCE else "s"
        head = ("i", b) if b != SINK else "t"
        if flow[(tail, head)] > FLOW_EPS:
            out[(a, b)] = flow[(tail, head)]
    return total, out


def decompose(edge_flow: dict[tuple[int, int], float]) -> list[tuple[tuple[int, ...], float]]:
    """Paths SOURCE -> SINK and their rates, from an acyclic edge flow."""
    left = {e: f for e, f in edge_flow.items() if f > FLOW_EPS}
    paths = []
    while True:
        starts = [e for e in left if e[0] == SOURCE]
        if not starts:
            break
        hops, at = [], SOURCE
        while at != SINK:
            nxt = max((e for e in left if e[0] == at), key=lambda e: left[e], default=None)
            if nxt is None:  # flow that does not reach the sink (rounding): drop it
                break
            hops.append(nxt)
            at = nxt[1]
        if at != SINK:
            left.pop(hops[0] if hops else starts[0], None)
            continue
        rate = min(left[e] for e in hops)
        for e in hops:
            left[e] -= rate
            if left[e] <= FLOW_EPS * 10:
                del left[e]
        paths.append((tuple(e[1] for e in hops[:-1]), rate))
    return paths


@dataclass(slots=True)
class _PathCost:
    devices: tuple[int, ...]
    pre: np.ndarray  # stage times at full speed
    dec: np.ndarray
    kv: np.ndarray  # KV of one micro-batch per stage


def _path_cost(one: PlanningInstance, stages_by_device: dict[int, Stage], devices) -> _PathCost:
    solution = Solution(tuple(stages_by_device[d] for d in devices))
    evaluation = evaluate(one, solution)
    return _PathCost(
        tuple(devices),
        np.array([s.time_prefill_s for s in evaluation.stages]),
        np.array([s.time_decode_s for s in evaluation.stages]),
        np.array([s.kv_bytes for s in evaluation.stages]),
    )


def fixed_bytes(one: PlanningInstance, stage: Stage) -> tuple[float, float]:
    """(bytes a device holds whatever the concurrency, KV of one micro-batch) for its range."""
    units = slice(stage.unit_start, stage.unit_end)
    weights = float(np.sum(one.weight_bytes[units]))
    weights += one.first_bytes if stage.unit_start == 0 else 0.0
    weights += one.last_bytes if stage.unit_end == one.n_units else 0.0
    return weights + float(one.workspace_bytes[stage.device]), float(np.sum(one.kv_bytes[units]))


def evaluate_flow(
    instance: PlanningInstance,
    stages,
    paths: list[tuple[tuple[int, ...], float]],
    micro_batch_size: int,
    max_micro_batches: int | None = None,
) -> FlowPlan | None:
    """The module docstring's throughput of placements `stages` with requests routed over `paths`
    ((devices, planned rate) each); None when no path can hold one micro-batch."""
    one = flow_instance(instance)
    n_out = one.decode_weight / one.prefill_weight
    by_device = {s.device: s for s in stages}
    costs = [_path_cost(one, by_device, devices) for devices, rate in paths if rate > FLOW_EPS]
    rates = [rate for _, rate in paths if rate > FLOW_EPS]
    free = {}
    for s in stages:
        fixed, _ = fixed_bytes(one, s)
        memory = one.devices[s.device].memory_bytes * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_BYTES
        free[s.device] = memory - fixed
    best = None
    for _ in range(SHARE_ROUNDS):
        if not costs:
            break
        shares = _time_shares(costs, rates, n_out)
        ks = _allocate(costs, shares, free, micro_batch_size, n_out, max_micro_batches)
        plan = _plan(stages, costs, shares, ks, micro_batch_size, n_out)
        if plan is not None and (best is None or plan.throughput_tok_s > best.throughput_tok_s * (1 + 1e-12)):
            best = plan
        keep = [i for i, k in enumerate(ks) if k > 0]
        if not keep:
            break
        new_rates = [_tok_s(costs[i], shares[i], ks[i], micro_batch_size, n_out) for i in keep]
        if len(keep) == len(costs) and np.allclose(new_rates, rates, rtol=1e-9):
            break
        costs, rates = [costs[i] for i in keep], new_rates
    return best


def price_paths(
    instance: PlanningInstance, stages, paths: list[tuple[tuple[int, ...], int]], micro_batch_size: int
) -> FlowPlan | None:
    """Placements with a fixed count of micro-batches per path ((devices, k) each), time shares in
    proportion to the counts' work: the throughput of a routing someone else chose (a baseline's).
    Refused (ValueError) when a device's memory does not hold its paths' KV."""
    one = flow_instance(instance)
    n_out = one.decode_weight / one.prefill_weight
    by_device = {s.device: s for s in stages}
    kept = [(d, k) for d, k in paths if k > 0]
    if not kept:
        return None
    costs = [_path_cost(one, by_device, d) for d, _ in kept]
    ks = [k for _, k in kept]
    held: dict[int, float] = defaultdict(float)
    for cost, k in zip(costs, ks, strict=True):
        for d, kv in zip(cost.devices, cost.kv, strict=True):
            held[d] += k * kv
    for s in stages:
        fixed, _ = fixed_bytes(one, s)
        memory = one.devices[s.device].memory_bytes * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_BYTES
        if fixed + held[s.device] > memory:
            raise ValueError(f"device {one.devices[s.device].name} does not hold its paths' KV")
    shares = _time_shares(costs, [float(k) for k in ks], n_out)
    return _plan(stages, costs, shares, ks, micro_batch_size, n_out)


def flow_instance(instance: PlanningInstance) -> PlanningInstance:
    """The instance flow plans are priced on: one micro-batch in flight (a path's count scales its
    KV), everything in GPU memory; units at fixed precisions (a choice is refused)."""
    if instance.precision is not None:
        raise ValueError("flow plans take units at fixed precisions: fix them first (PlanningInstance.fixed)")
    return gpu_memory_only(with_micro_batches(instance, 1))


def _time_shares(costs: list[_PathCost], rates: list[float], n_out: float) -> list[np.ndarray]:
    """phi_jp: each device's time split over its paths in proportion to the work their rates bring."""
    load: dict[int, float] = defaultdict(float)
    work = []
    for cost, rate in zip(costs, rates, strict=True):
        w = rate * (cost.pre + n_out * cost.dec)
        work.append(w)
        for d, x in zip(cost.devices, w, strict=True):
            load[d] += x
    return [
        np.array([x / load[d] if load[d] > 0 else 1.0 for d, x in zip(c.devices, w, strict=True)])
        for c, w in zip(costs, work, strict=True)
    ]


def _makespans(cost: _PathCost, share: np.ndarray, k: int) -> tuple[float, float]:
    """(prefill, decode) makespans of k micro-batches on a path (the module docstring's formula)."""
    out = []
    for times in (cost.pre, cost.dec):
        bottleneck = float((times / share).max())
        out.append(max(float(times.sum()) + (k - 1) * bottleneck, k * bottleneck))
    return out[0], out[1]


def _tok_s(cost: _PathCost, share: np.ndarray, k: int, b: int, n_out: float) -> float:
    if k <= 0:
        return 0.0
    ttft, tpot = _makespans(cost, share, k)
    total = ttft + n_out * tpot
    return k * b * n_out / total if total > 0 else 0.0


def _allocate(costs, shares, free, b, n_out, cap) -> list[int]:
    """k_p by greedy marginal throughput within every device's free memory (and `cap` in all)."""
    room = dict(free)
    ks = [0] * len(costs)
    gains = [_tok_s(c, s, 1, b, n_out) for c, s in zip(costs, shares, strict=True)]
    total = 0
    limit = cap if cap is not None else math.inf
    while total < limit:
        order = sorted(range(len(costs)), key=lambda i: -gains[i])
        placed = False
        for i in order:
            if gains[i] <= 0 or ks[i] >= MAX_MICRO_BATCHES:
                continue
            cost = costs[i]
            if all(room[d] >= kv for d, kv in zip(cost.devices, cost.kv, strict=True)):
                for d, kv in zip(cost.devices, cost.kv, strict=True):
                    room[d] -= kv
                ks[i] += 1
                now = _tok_s(cost, shares[i], ks[i], b, n_out)
                gains[i] = _tok_s(cost, shares[i], ks[i] + 1, b, n_out) - now
                placed = True
                break
        if not placed:
            break
        total += 1
    return ks


def queueing_rates(costs: list[_PathCost], ks: list[int], n_out: float) -> np.ndarray:
    """Micro-batch rounds per second of each path (k_p > 0) when its k_p micro-batches circulate and
    wait for one another at the devices they share, first come first served, as the simulator runs
    them (`tessel.sim.shared_devices`): mean value analysis of the closed network (Schweitzer's
    approximation). A round visits the path's devices once, for S = T_dec + T_pre / n_out (the
    prefill spread over the decode steps), and an arriving micro-batch waits for the ones queued
    ahead of it, the one in service counted for half its time (service times are fixed, not
    exponential); its own path's others are seen as (k_p - 1) / k_p of them."""
    index = [p for p, k in enumerate(ks) if k > 0]
    if not index:
        return np.zeros(len(ks))
    path = np.concatenate([np.full(len(costs[p].devices), i) for i, p in enumerate(index)])
    names = {d: n for n, d in enumerate(sorted({d for p in index for d in costs[p].devices}))}
    device = np.array([names[d] for p in index for d in costs[p].devices])
    service = np.concatenate([costs[p].dec + costs[p].pre / n_out for p in index])
    k = np.array([float(ks[p]) for p in index])
    kv = k[path]
    queue = kv / np.bincount(path)[path]
    rate = np.zeros(len(index))
    for _ in range(QUEUE_ITERATIONS):
        busy = np.minimum(rate[path] * service, queue)  # chance it is in service: at most its queue
        ahead = np.bincount(device, service * queue)[device] - service * queue / kv
        serving = np.bincount(device, service * busy)[device] - service * busy / kv
        response = service + np.maximum(ahead - 0.5 * serving, 0.0)
        new = k / np.bincount(path, response)
        queue = 0.5 * queue + 0.5 * new[path] * response
        if np.allclose(new, rate, rtol=QUEUE_RTOL, atol=0.0):
            rate = new
            break
        rate = new
    out = np.zeros(len(ks))
    out[index] = rate
    return out


def _plan(stages, costs, shares, ks, b, n_out) -> FlowPlan | None:
    paths = []
    queued = queueing_rates(costs, ks, n_out) * b
    counts = defaultdict(int)
    for cost, k in zip(costs, ks, strict=True):
        if k > 0:
            for d in cost.devices:
                counts[d] += 1
    for cost, share, k, waits in zip(costs, shares, ks, queued, strict=True):
        if k <= 0:
            continue
        ttft, tpot = _makespans(cost, share, k)
        rate = _tok_s(cost, share, k, b, n_out)
        if waits < rate:  # the queueing at shared devices costs more than the shares' bottleneck
            rate = float(waits)
            tpot = max((k * b * n_out / rate - ttft) / n_out, tpot)
        steady = steady_state_tok_s(cost.pre, cost.dec, k, b, n_out, share)
        if any(counts[d] > 1 for d in cost.devices):  # alone on its devices the closed cycle is exact
            steady = min(steady, float(waits))
        paths.append((cost.devices, k, rate, ttft, tpot, tuple(map(float, share)), steady))
    total = sum(p[2] for p in paths)
    if total <= 0:
        return None
    used = {d for p in paths for d in p[0]}
    kept = tuple(sorted((s for s in stages if s.device in used), key=lambda s: (s.unit_start, s.device)))
    return FlowPlan(
        kept,
        tuple(FlowPath(d, k, x, x / total, ttft, tpot, sh, y) for d, k, x, ttft, tpot, sh, y in paths),
        total,
    )


def from_pipelines(
    instance: PlanningInstance,
    pipelines: list[Solution],
    micro_batch_size: int,
    max_micro_batches: int | None = None,
) -> FlowPlan | None:
    """Disjoint pipelines (replicas) as a flow plan, concurrency by memory."""
    stages = [s for p in pipelines for s in p.stages]
    paths = [(p.devices, 1.0) for p in pipelines]
    return evaluate_flow(instance, stages, paths, micro_batch_size, max_micro_batches)


def route_placements(
    instance: PlanningInstance,
    stages,
    rates: dict[int, float],
    micro_batch_size: int,
    max_micro_batches: int | None = None,
) -> FlowPlan | None:
    """Placements with a planned rate per device: max flow over the placement graph under those
    rates (node capacities), decomposed into paths and evaluated."""
    check_placements(instance, stages)
    edges = placement_edges(stages, instance.n_units)
    value, edge_flow = max_flow(edges, rates)
    if value <= FLOW_EPS:
        return None
    return evaluate_flow(instance, stages, decompose(edge_flow), micro_batch_size, max_micro_batches)


def routed_counts(weights: list[float] | tuple[float, ...], n_requests: int) -> list[int]:
    """How many of `n_requests` each path gets when they are dealt in order by `weights`
    (`tessel.plan.replicas.weighted_turns`), as `tessel.sim.routing.route` and the runtime's router
    send them."""
    return dealt_counts(weights, n_requests)


def batch_throughput_tok_s(plan: FlowPlan, n_requests: int, micro_batch_size: int, n_out: float) -> float:
    """Tokens/s over a batch of `n_requests` requests that all arrive at once, routed by the plan's
    weights (`routed_counts`): the batch ends with its last path.

    Path p serves its n_p requests at its steady rate X_p, n_p n_out / X_p, but never in less than
    one micro-batch's lifetime b n_out / X_p (a path given fewer requests than one micro-batch holds
    still takes a full pass per token). With weights X_p / sum X and many requests every path ends
    together and this is `plan.throughput_tok_s`; with few, the paths' rounding and the floor show.
    Waves are not modelled: a path given a few more requests than its k_p b slots is priced as
    finishing them at its full rate, where the simulator serves the last few in a thinner wave."""
    if n_requests < 1:
        raise ValueError(f"a batch needs at least one request, got {n_requests}")
    counts = routed_counts([p.weight for p in plan.paths], n_requests)
    makespan = max(
        max(n, micro_batch_size) * n_out / path.throughput_tok_s
        for path, n in zip(plan.paths, counts, strict=True)
        if n > 0
    )
    return n_requests * n_out / makespan
