"""A plan as the solvers produce it, and the one evaluation that every solver reports through.

A `Solution` lists the used devices in pipeline order, each with a contiguous half-open range of
units; consecutive ranges meet, the first starts at unit 0 and the last ends at `n_units`.
Devices not listed stay idle.

`evaluate(instance, solution)` computes, per stage and per pass (prefill, decode), exactly the
quantities of `tessel.plan.instance`'s docstring:

    compute_j = sum of unit times (+ first_time when j is first, + last_time when j is last)
    comm_j    = send_s[j, next] (0 on the last stage)
    held_j    = weights + KV of its units + workspace_bytes[j] (+ first_bytes / last_bytes)
    offload_j = max(held_j - memory_bytes[j], 0) / host_to_device_bytes_per_s[j]
                (with `kv_restore`: streamed weights plus the evicted KV's swap or recompute;
                with `stream_layers`: the streamed weights rounded up to the whole layers the
                runtime copies, `tessel.plan.streamed.copied_bytes`)
    T_j       = compute + comm + offload        (overlap=False, the seed's additive form)
              = max(compute, comm, offload)     (overlap=True)
              = max(compute + offload, comm)    (overlap=True on a device whose copies share the
                                                 compute's cores, `copies_share_compute`: a CPU)
    objective = prefill_weight * (sum T^pre + (m - 1) max T^pre)
              + decode_weight  * (sum T^dec + (m - 1) max T^dec)
              + move_weight * move_s        (re-planning: seconds of weight movement the plan needs)
              + theta * quality             (precision choice: the plan's total quality cost)

and feasibility:

- offloaded bytes fit the device's host allowance: `held_j - memory_bytes[j] <= host_bytes[j]`;
- with `swap_in="hidden"` only, the swap-in is hidden under the upstream stage (SPEC section 2): a
  stage's offload time must not exceed the upstream stage's `compute + comm` (its `T - A` in the
  additive form) in either pass. The first stage has no upstream stage, so it may not offload (the
  SPEC's linear constraint has an empty right-hand side there). Offload time is the same in both
  passes (same bytes). With the default `swap_in="charged"` the transfer is only paid in T_j.
- with a precision choice, the plan's total quality cost is within the instance's budget.

With `kv_restore`, each stage's preemption mode is the cheaper of swap and recompute on its device
unless `Solution.kv_modes` fixes one per stage (the brute force tries both).

With a precision choice, unit u's bytes and times are those of its precision (`Solution.precisions`,
an index per unit; None means every unit at the reference precision, index 0).

MILP, DP, brute force and the baselines all call this function, so they agree on one number.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from tessel.plan.instance import KV_PREEMPTION_MODES, PassCosts, PlanningInstance
from tessel.plan.streamed import copied_bytes

# Relative slack on feasibility checks, so a MILP solution that sits on a constraint within the
# solver's feasibility tolerance (1e-7 on scaled rows) is not rejected.
FEASIBILITY_RTOL = 1e-6
FEASIBILITY_ATOL_S = 1e-9
FEASIBILITY_ATOL_BYTES = 1.0


@dataclass(frozen=True, slots=True)
class Stage:
    device: int  # index into instance.devices
    unit_start: int
    unit_end: int  # half-open

    @property
    def n_units(self) -> int:
        return self.unit_end - self.unit_start


@dataclass(frozen=True, slots=True)
class Solution:
    stages: tuple[Stage, ...]
    precisions: tuple[int, ...] | None = None  # precision index per unit (None: the reference, 0)
    kv_modes: tuple[str, ...] | None = None  # preemption mode per stage (None: the cheaper on each)

    def with_precisions(self, precisions) -> Solution:
        q = None if precisions is None else tuple(int(q) for q in precisions)
        return Solution(self.stages, q, self.kv_modes)

    def with_kv_modes(self, modes) -> Solution:
        return Solution(self.stages, self.precisions, None if modes is None else tuple(modes))

    @classmethod
    def from_counts(cls, devices: list[int] | tuple[int, ...], counts: list[int]) -> Solution:
        """Stages from a device order and unit counts per device (zero counts are skipped)."""
        stages, start = [], 0
        for device, count in zip(devices, counts, strict=True):
            if count > 0:
                stages.append(Stage(int(device), start, start + int(count)))
                start += int(count)
        return cls(tuple(stages))

    def validate(self, instance: PlanningInstance) -> None:
        """Raise ValueError unless the stages tile all units with distinct devices."""
        if not self.stages:
            raise ValueError("a solution needs at least one stage")
        seen: set[int] = set()
        expected_start = 0
        for stage in self.stages:
            if not 0 <= stage.device < instance.n_devices:
                raise ValueError(f"device index {stage.device} out of range")
            if stage.device in seen:
                raise ValueError(f"device {stage.device} holds two stages")
            seen.add(stage.device)
            if stage.unit_start != expected_start or stage.unit_end <= stage.unit_start:
                raise ValueError(f"stage {stage} does not continue at unit {expected_start}")
            expected_start = stage.unit_end
        if expected_start != instance.n_units:
            raise ValueError(f"stages end at unit {expected_start}, expected {instance.n_units}")
        if self.precisions is not None:
            if len(self.precisions) != instance.n_units:
                raise ValueError(f"{len(self.precisions)} precisions for {instance.n_units} units")
            if any(not 0 <= q < instance.n_precisions for q in self.precisions):
                raise ValueError(f"precision index out of range 0..{instance.n_precisions - 1}")
        if self.kv_modes is not None:
            if len(self.kv_modes) != len(self.stages):
                raise ValueError(f"{len(self.kv_modes)} kv modes for {len(self.stages)} stages")
            if any(mode not in KV_PREEMPTION_MODES for mode in self.kv_modes):
                raise ValueError(f"kv modes must be in {KV_PREEMPTION_MODES}, got {self.kv_modes}")

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(stage.device for stage in self.stages)

    def assignment(self, n_units: int) -> np.ndarray:
        """Device index per unit."""
        owner = np.full(n_units, -1, dtype=int)
        for stage in self.stages:
            owner[stage.unit_start : stage.unit_end] = stage.device
        return owner


@dataclass(frozen=True, slots=True)
class StageEval:
    stage: Stage
    compute_prefill_s: float
    compute_decode_s: float
    comm_prefill_s: float
    comm_decode_s: float
    offload_s: float
    time_prefill_s: float  # T_j^pre
    time_decode_s: float  # T_j^dec
    weight_bytes: float  # weights of its units (+ embedding / LM head when first / last)
    kv_bytes: float
    workspace_bytes: float
    held_bytes: float
    offload_bytes: float  # held beyond device memory: streamed from host, or evicted KV
    kv_evicted_bytes: float = 0.0  # of offload_bytes, KV evicted and brought back by kv_preemption
    kv_preemption: str | None = None  # "swap" or "recompute" (None: the instance prices no KV restore)
    streamed_bytes: float = 0.0  # weight bytes copied in per pass (whole layers with stream_layers)


@dataclass(frozen=True, slots=True)
class Evaluation:
    stages: tuple[StageEval, ...]
    prefill_makespan_s: float  # sum T^pre + (m - 1) max T^pre
    decode_makespan_s: float  # sum T^dec + (m - 1) max T^dec
    objective: float
    feasible: bool
    reasons: tuple[str, ...]  # why infeasible (empty when feasible)
    move_s: float = 0.0  # seconds of weight movement from the previous plan (re-planning only)
    quality: float = 0.0  # total quality cost of the plan's precisions (0 without a precision choice)
    precisions: tuple[str, ...] | None = None  # precision name per unit (None: no precision choice)

    @property
    def offload_bytes(self) -> float:
        return sum(stage.offload_bytes for stage in self.stages)

    @property
    def max_prefill_s(self) -> float:
        return max(stage.time_prefill_s for stage in self.stages)

    @property
    def max_decode_s(self) -> float:
        return max(stage.time_decode_s for stage in self.stages)


def _stage_compute(costs: PassCosts, device: int, start: int, end: int, first: bool, last: bool) -> float:
    time = float(np.sum(costs.unit_time_s[start:end, device]))
    if first:
        time += float(costs.first_time_s[device])
    if last:
        time += float(costs.last_time_s[device])
    return time


def _combine(compute: float, comm: float, offload: float, overlap: bool, shared: bool = False) -> float:
    """T_j; `shared`: the device's copies take the compute's cores, so they never overlap it."""
    if not overlap:
        return compute + comm + offload
    return max(compute + offload, comm) if shared else max(compute, comm, offload)


def stage_layer_bytes(instance: PlanningInstance, start: int, end: int) -> list[float]:
    """Weight bytes of each decoder layer among units [start, end), in order (a layer's attention and
    MLP units add up): the pieces the runtime streams."""
    pieces: list[float] = []
    previous = None
    for u in range(start, end):
        layer = instance.units[u].layer
        if layer == previous:
            pieces[-1] += float(instance.weight_bytes[u])
        else:
            pieces.append(float(instance.weight_bytes[u]))
        previous = layer
    return pieces


def offload_time_s(offload_bytes: float, bytes_per_s: float) -> float:
    if offload_bytes <= 0.0:
        return 0.0
    return offload_bytes / bytes_per_s if bytes_per_s > 0 else float("inf")


def split_offload(held, kv, memory, bytes_per_s, kv_s_per_byte):
    """(offload seconds, evicted KV bytes) of a stage holding `held` bytes, `kv` of them KV, on a
    device of `memory` bytes: the bytes that cost less per byte leave first, weights streamed at
    `bytes_per_s` or KV brought back at `kv_s_per_byte` (instance docstring). numpy broadcasts."""
    held, kv = np.asarray(held, dtype=float), np.asarray(kv, dtype=float)
    over = np.maximum(held - memory, 0.0)
    bw = np.asarray(bytes_per_s, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        weight_s_per_byte = np.where(bw > 0, 1.0 / bw, np.inf)
        kv_first = kv_s_per_byte < weight_s_per_byte
        evicted = np.where(kv_first, np.minimum(over, kv), np.maximum(over - (held - kv), 0.0))
        streamed = over - evicted
        seconds = np.where(streamed > 0, streamed * weight_s_per_byte, 0.0) + evicted * kv_s_per_byte
    return seconds, evicted


def evaluate(instance: PlanningInstance, solution: Solution) -> Evaluation:
    """Stage times, memory, offloading, feasibility and the objective of one plan."""
    solution.validate(instance)
    if instance.precision is not None:
        return _evaluate_precisions(instance, solution)
    n_stages = len(solution.stages)
    results: list[StageEval] = []
    reasons: list[str] = []
    for index, stage in enumerate(solution.stages):
        j = stage.device
        device = instance.devices[j]
        first, last = index == 0, index == n_stages - 1
        nxt = None if last else solution.stages[index + 1].device
        units = slice(stage.unit_start, stage.unit_end)
        weights = float(np.sum(instance.weight_bytes[units]))
        weights += (instance.first_bytes if first else 0.0) + (instance.last_bytes if last else 0.0)
        kv = float(np.sum(instance.kv_bytes[units]))
        workspace = float(instance.workspace_bytes[j])
        held = weights + kv + workspace
        offload_bytes = max(held - device.memory_bytes, 0.0)
        offload = offload_time_s(offload_bytes, device.host_to_device_bytes_per_s)
        evicted, mode = 0.0, None
        if instance.kv_restore is not None:
            mode = instance.kv_restore.modes()[j] if solution.kv_modes is None else solution.kv_modes[index]
            seconds, evicted = split_offload(
                held,
                kv,
                device.memory_bytes,
                device.host_to_device_bytes_per_s,
                instance.kv_rate_s_per_byte(j, mode),
            )
            offload, evicted = float(seconds), float(evicted)
        streamed = offload_bytes - evicted
        if instance.stream_layers and streamed > 0:
            layers = stage_layer_bytes(instance, stage.unit_start, stage.unit_end)
            streamed = copied_bytes(layers, streamed)
            kv_s = 0.0 if mode is None else evicted * instance.kv_rate_s_per_byte(j, mode)
            offload = offload_time_s(streamed, device.host_to_device_bytes_per_s) + kv_s
        times = {}
        for name, costs in (("prefill", instance.prefill), ("decode", instance.decode)):
            compute = _stage_compute(costs, j, stage.unit_start, stage.unit_end, first, last)
            comm = 0.0 if nxt is None else float(costs.send_s[j, nxt])
            total = _combine(compute, comm, offload, instance.overlap, device.copies_share_compute)
            times[name] = (compute, comm, total)
        if offload_bytes > device.host_bytes * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_BYTES:
            reasons.append(
                f"{device.name}: holds {held / 2**30:.2f} GiB, {offload_bytes / 2**30:.2f} GiB over its "
                f"{device.memory_bytes / 2**30:.2f} GiB, more than its {device.host_bytes / 2**30:.2f} GiB "
                "of host memory"
            )
        results.append(
            StageEval(
                stage=stage,
                compute_prefill_s=times["prefill"][0],
                compute_decode_s=times["decode"][0],
                comm_prefill_s=times["prefill"][1],
                comm_decode_s=times["decode"][1],
                offload_s=offload,
                time_prefill_s=times["prefill"][2],
                time_decode_s=times["decode"][2],
                weight_bytes=weights,
                kv_bytes=kv,
                workspace_bytes=workspace,
                held_bytes=held,
                offload_bytes=offload_bytes,
                kv_evicted_bytes=evicted,
                kv_preemption=mode,
                streamed_bytes=streamed,
            )
        )
    if instance.swap_in == "hidden":
        reasons.extend(_swap_in_violations(instance, results))
    m = instance.micro_batches
    pre = [stage.time_prefill_s for stage in results]
    dec = [stage.time_decode_s for stage in results]
    prefill_makespan = sum(pre) + (m - 1) * max(pre)
    decode_makespan = sum(dec) + (m - 1) * max(dec)
    objective = instance.prefill_weight * prefill_makespan + instance.decode_weight * decode_makespan
    move = move_time_s(instance, solution)
    objective += instance.move_weight * move
    return Evaluation(
        stages=tuple(results),
        prefill_makespan_s=prefill_makespan,
        decode_makespan_s=decode_makespan,
        objective=objective,
        feasible=not reasons,
        reasons=tuple(reasons),
        move_s=move,
    )


def _evaluate_precisions(instance: PlanningInstance, solution: Solution) -> Evaluation:
    """The plan on the instance with its precisions fixed, plus the quality term and budget."""
    choice = instance.precision
    q = solution.precisions
    base = evaluate(instance.fixed(q), Solution(solution.stages, kv_modes=solution.kv_modes))
    quality = instance.quality_cost(q)
    reasons = list(base.reasons)
    if quality > choice.quality_budget * (1 + FEASIBILITY_RTOL) + 1e-12:
        reasons.append(f"quality cost {quality:.4g} exceeds the budget {choice.quality_budget:.4g}")
    names = tuple(choice.names[i] for i in (q or (0,) * instance.n_units))
    return replace(
        base,
        objective=base.objective + choice.theta * quality,
        feasible=not reasons,
        reasons=tuple(reasons),
        quality=quality,
        precisions=names,
    )


def move_time_s(instance: PlanningInstance, solution: Solution) -> float:
    """Seconds of weight movement a plan needs (0 without re-planning costs)."""
    if instance.move_s is None:
        return 0.0
    return float(sum(np.sum(instance.move_s[s.unit_start : s.unit_end, s.device]) for s in solution.stages))


def swap_window_s(stage: StageEval) -> float:
    """How long an upstream stage works (compute + send) while the next one swaps in."""
    return min(stage.compute_prefill_s + stage.comm_prefill_s, stage.compute_decode_s + stage.comm_decode_s)


def _swap_in_violations(instance: PlanningInstance, stages: list[StageEval]) -> list[str]:
    reasons = []
    for index, stage in enumerate(stages):
        if stage.offload_bytes <= 0.0:
            continue
        name = instance.devices[stage.stage.device].name
        if index == 0:
            reasons.append(
                f"{name}: first stage would offload {stage.offload_bytes / 2**30:.2f} GiB, but no upstream "
                "stage hides its swap-in"
            )
            continue
        window = swap_window_s(stages[index - 1])
        if stage.offload_s > window * (1 + FEASIBILITY_RTOL) + FEASIBILITY_ATOL_S:
            reasons.append(
                f"{name}: swap-in of {stage.offload_bytes / 2**30:.2f} GiB takes "
                f"{stage.offload_s * 1e3:.2f} ms, "
                f"longer than the {window * 1e3:.2f} ms the upstream stage works"
            )
    return reasons


def first_stage_on(
    instance: PlanningInstance, solution: Solution, node: str
) -> tuple[Solution, Evaluation] | None:
    """`solution` with its first stage on a device of `node` (where a Ray pipeline's stage 0 runs: the
    command's machine), and its evaluation: as it is when it starts there, else the best feasible
    placement of its stages, split unchanged, with the first on one of `node`'s devices (used or
    idle); None when none is feasible. The solvers choose a device order freely; this keeps their
    split and moves it."""
    first = solution.stages[0].device
    if instance.devices[first].node == node:
        return solution, evaluate(instance, solution)
    best: tuple[Solution, Evaluation] | None = None
    for devices in _placements_starting_on(instance, solution, node):
        stages = tuple(replace(s, device=d) for s, d in zip(solution.stages, devices, strict=True))
        moved = replace(solution, stages=stages)
        evaluation = evaluate(instance, moved)
        if evaluation.feasible and (best is None or evaluation.objective < best[1].objective):
            best = (moved, evaluation)
    return best


MAX_PLACEMENTS = 2000  # past this many, only the swaps and shifts below are tried


def _placements_starting_on(
    instance: PlanningInstance, solution: Solution, node: str
) -> list[tuple[int, ...]]:
    """Device tuples for the solution's stages, the first on `node`, drawn from the devices it uses
    and `node`'s: every ordering when there are few (a swap alone can put a slow link where the
    solver had none), else the first device swapped with one of `node`'s, or the stages shifted one
    device along the solver's order behind it."""
    used = [s.device for s in solution.stages]
    mine = [d for d, slot in enumerate(instance.devices) if slot.node == node]
    pool = list(dict.fromkeys(used + mine))
    count = len(mine) * math.perm(len(pool) - 1, len(used) - 1)
    if count <= MAX_PLACEMENTS:
        return [
            (head, *rest)
            for head in mine
            for rest in itertools.permutations([d for d in pool if d != head], len(used) - 1)
        ]
    placements = []
    for head in mine:
        placements.append(tuple(head if d == used[0] else used[0] if d == head else d for d in used))
        behind = [d for d in used if d != head]
        placements.append((head, *behind[: len(used) - 1]))
    return placements
