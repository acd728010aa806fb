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

Weight precisions (`tessel plan --precisions`): the previous plan's units keep the precisions its
file gives, and the solver may re-choose them under the new instance's precisions and budget. A unit
at precision q on device j then costs, besides any move of the embedding or LM head:
- when q holds no more bytes per weight than the unit's previous precision q0 (the same precision,
  or fewer bits, e.g. fp16 -> int8), its q weights sent from its previous device over the cluster
  link (quantised there; nothing is sent when j is that device: re-quantising in place is not
  charged);
- otherwise (more bytes than the previous device holds, e.g. int8 -> fp16), its q weights loaded
  from the host over device j's host-to-device PCIe (the checkpoint lives in host memory).
`ReplanDecision.precision_changes` lists the units whose precision the new plan changes.

The previous plan must be for the same model (`check_same_model`: same name and the same weight
shapes): its weights are what moves, and another model's weights cannot become this one's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from tessel.cost.link import link_time_s
from tessel.errors import TesselError
from tessel.plan.files.cluster import Cluster
from tessel.plan.files.plan_parts import PlanStage
from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import Evaluation, Solution, Stage, evaluate, first_stage_on
from tessel.plan.solvers.solve import PlanResult, solve

if TYPE_CHECKING:
    from tessel.catalog.models import ModelSpec
    from tessel.plan.files.plan_file import PlanFile

# ModelSpec fields that fix the weights' shapes: two models that differ in one hold different weights
WEIGHT_SHAPE_FIELDS = (
    "architecture",
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tied_embeddings",
    "mlp_kind",
    "num_experts",
)


@dataclass(frozen=True, slots=True)
class PrecisionChange:
    """A run of consecutive units whose precision goes from `old` to `new` (half-open units)."""

    unit_start: int
    unit_end: int
    old: str
    new: str


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
    precision_changes: tuple[PrecisionChange, ...] = ()  # what the new plan re-quantises

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


def check_same_model(previous: PlanFile, model: ModelSpec) -> None:
    """The previous plan is for `model` (same name, same weight shapes), or a user error naming both:
    re-planning prices moving the previous plan's weights, which are meaningless for another model."""
    old = previous.model_spec
    differences = [
        f"{name} {getattr(old, name)} vs {getattr(model, name)}"
        for name in WEIGHT_SHAPE_FIELDS
        if getattr(old, name) != getattr(model, name)
    ]
    if previous.model.name == model.name and not differences:
        return
    shapes = f" ({', '.join(differences[:3])})" if differences else ""
    raise TesselError(
        f"{previous.source} is a plan for model {previous.model.name!r}, not {model.name!r}{shapes}: "
        "re-planning prices moving the old plan's weights, and those are another model's; plan "
        f"{model.name!r} without --replan-from, or re-plan from a plan made for it"
    )


def previous_solution(
    instance: PlanningInstance, stages: Sequence[PlanStage], source: str, default_precision: str | None = None
) -> Solution:
    """The stages of a plan file (`tessel.plan.files.plan_file.load_plan`) as a solution of `instance`
    (devices by name), with its units' precisions when `instance` chooses them. A stage without
    precisions holds `default_precision` (the plan's `reference_dtype`; None: the instance's dtype)."""
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
    return solution.with_precisions(_previous_precisions(instance, stages, source, default_precision))


def _previous_precisions(
    instance: PlanningInstance, stages: Sequence[PlanStage], source: str, default: str | None
) -> tuple[int, ...] | None:
    """Index per unit into the instance's precisions (None without a precision choice), or a user
    error when the previous plan holds a precision this re-planning cannot price."""
    dtype = instance.labels.get("dtype", "fp16")
    names = instance.precision.names if instance.precision is not None else (dtype,)
    vector = []
    for position, stage in enumerate(stages):
        for offset, name in enumerate(stage.unit_precisions(default or dtype)):
            if name in names:
                vector.append(names.index(name))
                continue
            unit = stage.unit_start + offset
            allowed = (
                f"--precisions {','.join(names)}" if instance.precision is not None else f"--dtype {dtype}"
            )
            raise TesselError(
                f"{source}: stage {position} holds unit {unit} at {name}, which {allowed} does not "
                f"include; re-plan with --precisions listing {name} (and the others the plan uses)"
            )
    return tuple(vector) if instance.precision is not None else None


def precision_changes(
    instance: PlanningInstance, previous: Solution, new: Solution
) -> tuple[PrecisionChange, ...]:
    """Runs of units whose precision differs between two plans of `instance` (empty without a choice)."""
    if instance.precision is None or previous.precisions is None:
        return ()
    names = instance.precision.names
    old_q, new_q = previous.precisions, new.precisions or (0,) * instance.n_units
    changes: list[PrecisionChange] = []
    for u, (a, b) in enumerate(zip(old_q, new_q, strict=True)):
        if a == b:
            continue
        last = changes[-1] if changes else None
        if last is not None and last.unit_end == u and (last.old, last.new) == (names[a], names[b]):
            changes[-1] = PrecisionChange(last.unit_start, u + 1, last.old, last.new)
        else:
            changes.append(PrecisionChange(u, u + 1, names[a], names[b]))
    return tuple(changes)


def move_costs(
    instance: PlanningInstance, cluster: Cluster, previous: Solution
) -> tuple[np.ndarray, np.ndarray]:
    """Seconds and bytes to bring each unit onto each device, [U, N] each (0 where it already is);
    [U, N, P] with a precision choice and a previous plan with precisions (module docstring).

    Unit u on device j needs its weights from their previous device unless that is j; unit 0 also
    needs the embedding unless j was the first stage, unit U-1 the LM head unless j was the last."""
    U, N = instance.n_units, instance.n_devices
    owner = previous.assignment(U)
    names = [device.name for device in instance.devices]
    first, last = previous.stages[0].device, previous.stages[-1].device

    def send_s(source: int, target: int, n_bytes: float) -> float:
        return link_time_s(cluster.link(names[source], names[target]), n_bytes)

    ends_s, ends_bytes = np.zeros((U, N)), np.zeros((U, N))  # embedding (unit 0), LM head (unit U-1)
    for u, source, n_bytes in ((0, first, instance.first_bytes), (U - 1, last, instance.last_bytes)):
        for j in range(N):
            if source != j and n_bytes > 0:
                ends_bytes[u, j] += n_bytes
                ends_s[u, j] += send_s(source, j, n_bytes)
    if instance.precision is None or previous.precisions is None:
        unit_bytes = np.where(owner[:, None] != np.arange(N)[None, :], instance.weight_bytes[:, None], 0.0)
        unit_s = np.array(
            [
                [send_s(owner[u], j, unit_bytes[u, j]) if unit_bytes[u, j] > 0 else 0.0 for j in range(N)]
                for u in range(U)
            ]
        )
        return unit_s + ends_s, unit_bytes + ends_bytes
    choice = instance.precision
    held = choice.weight_bytes[np.arange(U), np.asarray(previous.precisions)]
    seconds, moved = np.zeros((U, N, len(choice.names))), np.zeros((U, N, len(choice.names)))
    for (u, j, q), _ in np.ndenumerate(seconds):
        n_bytes = float(choice.weight_bytes[u, q])
        if n_bytes > held[u] * (1 + 1e-12):  # more than the previous device holds: from the host
            seconds[u, j, q] = n_bytes / instance.devices[j].host_to_device_bytes_per_s
            moved[u, j, q] = n_bytes
        elif owner[u] != j:  # quantised (if at all) on the previous device, then sent
            seconds[u, j, q] = send_s(owner[u], j, n_bytes)
            moved[u, j, q] = n_bytes
    return seconds + ends_s[..., None], moved + ends_bytes[..., None]


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
    first_node: str | None = None,
) -> ReplanDecision:
    """Decide between the previous plan and a new one for `instance`'s (new) workload (`first_node`:
    the node the new plan's first stage must run on, as a Ray pipeline's stage 0 runs where its
    server does)."""
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
    if first_node is not None:
        pinned = first_stage_on(costed, new.solution, first_node)
        if pinned is None:
            reason = f"no new plan is feasible with its first stage on {first_node}"
            return ReplanDecision(previous, old, new, 0.0, 0.0, 0.0, False, reason)
        new = replace(new, solution=pinned[0], evaluation=pinned[1])
    if moved.ndim == 3:  # at the precisions the new plan chose
        moved = moved[np.arange(instance.n_units), :, np.asarray(new.solution.precisions)]
    move_bytes = float(sum(np.sum(moved[s.unit_start : s.unit_end, s.device]) for s in new.solution.stages))
    changes = precision_changes(instance, previous, new.solution)
    if not old.feasible:
        reason = "the previous plan does not fit the new workload: " + "; ".join(old.reasons)
        return ReplanDecision(
            previous, old, new, move_bytes, new.evaluation.move_s, np.inf, True, reason, changes
        )
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
    return ReplanDecision(previous, old, new, move_bytes, new.evaluation.move_s, gain, take, reason, changes)
