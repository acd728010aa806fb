"""When to remap a serving pipeline: a sliding window of what it measures, and the decision.

One pure decision, run at one cadence by the pipeline server
(`tessel.pipeline.supervision.remap_watch`) and by the simulator (`tessel.sim.remap`), so both
reach the same decision from the same measurements.

The window (`RemapWindow`) holds samples of each stage's cumulative counters (micro-batches, busy
seconds = compute + any emulated slowdown) and the requests seen (arrival time, prompt tokens; output
tokens when they finish). Over the last `window_s` seconds it gives each stage's mean seconds per
micro-batch, the arrival rate and the mean prompt and output lengths (`WindowStats`).

The decision (`RemapDecider.evaluate`), every `interval_s`:
1. Each stage's measured step over its predicted step (the plan's `decode_ms`; decode dominates a
   serving pipeline's micro-batches) is its ratio r_k. Stages take the same micro-batches, so the
   ratios compare like with like; what the cost model gets wrong for every stage cancels. A stage's
   estimated speed is its assumed speed x min_j r_j / r_k, scaled so the fastest is 1.
2. Drift: a stage whose estimated speed differs from its assumed one by at least `min_slowdown`
   (either way), or, over a full window with `min_requests` arrivals, an arrival rate or mean prompt
   length `workload_drift` times the plan's or less (output lengths, known only as requests finish,
   re-price a drifted workload but do not trigger). No drift: "steady".
3. Re-plan (`tessel.plan.remap.replan.replan`) on the cluster re-priced with the estimated speeds of the
   drifted stages (their devices' FLOP/s and bandwidth scaled) and the measured workload: migration
   cost = weight bytes moved / link bandwidth, amortised over `horizon_s`, taken when the gain
   reaches `threshold`.
4. Hysteresis: a remap is taken only when `confirm` evaluations in a row want it, never within
   `cooldown_s` of the last one; after a remap the window restarts (the old stages' times no longer
   describe the new split) and the new plan's predictions are what later windows are held against.

Every evaluation returns a `RemapDecision` with its numbers (`describe()` is the log line).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tessel.errors import TesselError
from tessel.plan.files.cluster import Cluster
from tessel.plan.files.plan_file import PlanFile

OUTCOMES = ("insufficient", "steady", "cooldown", "kept", "unconfirmed", "remap")
MAX_HORIZON_S = 365 * 24 * 3600.0  # a year of serving: beyond it the move cost is nil anyway
# A second of serving: moving weights takes seconds, so a remap amortised over less never pays.
MIN_HORIZON_S = 1.0
MAX_INTERVAL_S = 24 * 3600.0
# The stages' counters arrive with their heartbeats, at most every 0.1 s
# (tessel.pipeline.supervision.heartbeat: MIN_HEARTBEAT_TIMEOUT_S / BEATS_PER_TIMEOUT); deciding more
# often re-reads the same numbers, and a simulated run of seconds would take billions of decisions
# (1e-9 s: one per simulated nanosecond).
MIN_INTERVAL_S = 0.1


@dataclass(frozen=True, slots=True)
class RemapSettings:
    """`tessel serve --remap auto` options; each refused out of range or NaN with its flag's name."""

    threshold: float = 0.1  # least gain (fraction of the plan's objective) that pays for a remap
    horizon_s: float = 600.0  # seconds of serving the move cost is amortised over
    interval_s: float = 2.0  # seconds between evaluations
    window_s: float = 10.0  # seconds of measurements an evaluation reads
    min_slowdown: float = 1.5  # a stage this much slower (or faster) than assumed has drifted
    workload_drift: float = 2.0  # a workload figure this many times the plan's has drifted
    min_batches: int = 8  # micro-batches every stage must have run in the window
    min_requests: int = 8  # requests seen in the window before its workload is believed
    cooldown_s: float = 30.0  # no remap within this many seconds of the last one
    confirm: int = 2  # evaluations in a row that must want the same remap

    def __post_init__(self) -> None:
        _in_range("--remap-threshold", self.threshold, 0.0, 1.0, high_open=True)
        _in_range("--remap-horizon-s", self.horizon_s, MIN_HORIZON_S, MAX_HORIZON_S)
        _in_range("--remap-interval-s", self.interval_s, MIN_INTERVAL_S, MAX_INTERVAL_S)
        _in_range("--remap-window-s", self.window_s, self.interval_s, MAX_INTERVAL_S)
        _in_range("--remap-min-slowdown", self.min_slowdown, 1.0, 100.0, low_open=True)
        _in_range("--remap-workload-drift", self.workload_drift, 1.0, 1e6, low_open=True)
        _in_range("--remap-cooldown-s", self.cooldown_s, 0.0, MAX_HORIZON_S)
        for name, value in (("min_batches", self.min_batches), ("min_requests", self.min_requests)):
            _in_range(f"--remap-{name.replace('_', '-')}", value, 1, 10**9)
        _in_range("--remap-confirm", self.confirm, 1, 1000)


def _in_range(
    flag: str, value: float, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        raise TesselError(f"{flag} must be a finite number in {left}{low:g}, {high:g}{right}, got {value!r}")


# ---- the window ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StageCounters:
    """A stage's cumulative counters as it reports them (heartbeat, or stage 0's own stats)."""

    batches: int
    busy_s: float  # compute + emulated slowdown


@dataclass(frozen=True, slots=True)
class WindowStats:
    span_s: float  # seconds between the window's first and last stage sample
    batches: tuple[int, ...]  # per stage, micro-batches in the window
    step_s: tuple[float | None, ...]  # per stage, mean busy seconds per micro-batch (None: none ran)
    requests: int  # requests that arrived in the window
    arrival_rate_per_s: float | None
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None  # of the requests that finished in the window


@dataclass(slots=True)
class RemapWindow:
    window_s: float
    _samples: deque[tuple[float, tuple[StageCounters, ...]]] = field(default_factory=deque)
    _arrivals: deque[tuple[float, int]] = field(default_factory=deque)
    _finishes: deque[tuple[float, int]] = field(default_factory=deque)

    def observe_stages(self, time_s: float, counters: Sequence[StageCounters]) -> None:
        counters = tuple(counters)
        if self._samples and len(self._samples[-1][1]) != len(counters):
            self.reset()  # another pipeline (a remap): its counters start afresh
        elif self._samples and any(
            new.batches < old.batches for new, old in zip(counters, self._samples[-1][1], strict=True)
        ):
            self.reset()  # a stage restarted: its counters went back
        self._samples.append((time_s, counters))
        self._trim(time_s)

    def observe_arrival(self, time_s: float, prompt_tokens: int) -> None:
        self._arrivals.append((time_s, prompt_tokens))

    def observe_finish(self, time_s: float, output_tokens: int) -> None:
        self._finishes.append((time_s, output_tokens))

    def reset(self) -> None:
        self._samples.clear()
        self._arrivals.clear()
        self._finishes.clear()

    def _trim(self, now_s: float) -> None:
        start = now_s - self.window_s
        # keep one sample at or before the window's start: the window's deltas begin there
        while len(self._samples) > 1 and self._samples[1][0] <= start:
            self._samples.popleft()
        for events in (self._arrivals, self._finishes):
            while events and events[0][0] < start:
                events.popleft()

    def stats(self, now_s: float) -> WindowStats | None:
        """The window ending at `now_s`; None before two stage samples."""
        self._trim(now_s)
        if len(self._samples) < 2:
            return None
        (t0, first), (t1, last) = self._samples[0], self._samples[-1]
        batches = tuple(b.batches - a.batches for a, b in zip(first, last, strict=True))
        step_s = tuple(
            (b.busy_s - a.busy_s) / n if n > 0 else None for a, b, n in zip(first, last, batches, strict=True)
        )
        span_s = max(t1 - t0, 0.0)
        arrivals = [tokens for t, tokens in self._arrivals if t <= now_s]
        outputs = [tokens for t, tokens in self._finishes if t <= now_s]
        rate = len(arrivals) / min(self.window_s, span_s) if arrivals and span_s > 0 else None
        return WindowStats(
            span_s,
            batches,
            step_s,
            len(arrivals),
            rate,
            sum(arrivals) / len(arrivals) if arrivals else None,
            sum(outputs) / len(outputs) if outputs else None,
        )


# ---- the decision --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RemapDecision:
    time_s: float
    outcome: str  # one of OUTCOMES
    reason: str
    measured_step_s: tuple[float | None, ...] = ()
    predicted_step_s: tuple[float, ...] = ()
    speeds: tuple[float, ...] = ()  # per stage, the speed the decision priced its device at
    gain: float | None = None  # (old - new) / old objective, the new one with its amortised move
    old_objective: float | None = None
    new_objective: float | None = None
    move_bytes: float | None = None
    move_s: float | None = None
    old_layers: tuple[tuple[int, int], ...] = ()
    new_layers: tuple[tuple[int, int], ...] = ()  # the re-plan's split (kept or not)
    old_devices: tuple[str, ...] = ()  # the stages' devices, in pipeline order
    new_devices: tuple[str, ...] = ()
    new_plan: PlanFile | None = None  # set when outcome is "remap"

    @property
    def taken(self) -> bool:
        return self.outcome == "remap"

    def describe(self) -> str:
        """One log line with the decision's numbers."""

        def fmt(values, unit=""):
            return "[" + ", ".join("-" if v is None else f"{v:.4g}{unit}" for v in values) + "]"

        parts = [f"remap decision at {self.time_s:.1f} s: {self.outcome} ({self.reason})"]
        if self.measured_step_s:
            parts.append(f"measured step {fmt(self.measured_step_s, ' s')}")
            parts.append(f"predicted {fmt(self.predicted_step_s, ' s')}")
        if self.speeds:
            parts.append(f"speeds {fmt(self.speeds)}")
        if self.gain is not None:
            parts.append(
                f"gain {self.gain:.1%}, objective {self.old_objective:.4g} -> {self.new_objective:.4g}, "
                f"move {self.move_bytes / 2**20:.1f} MiB in {self.move_s:.3g} s"
            )
        if self.new_layers:
            old, new = _split(self.old_layers, self.old_devices), _split(self.new_layers, self.new_devices)
            parts.append(f"layers {old} -> {new}")
        return "; ".join(parts)

    def to_json(self) -> dict:
        return {
            "time_s": self.time_s,
            "outcome": self.outcome,
            "reason": self.reason,
            "measured_step_s": list(self.measured_step_s),
            "predicted_step_s": list(self.predicted_step_s),
            "speeds": list(self.speeds),
            "gain": self.gain,
            "old_objective": self.old_objective,
            "new_objective": self.new_objective,
            "move_bytes": self.move_bytes,
            "move_s": self.move_s,
            "old_layers": [list(r) for r in self.old_layers],
            "new_layers": [list(r) for r in self.new_layers],
            "old_devices": list(self.old_devices),
            "new_devices": list(self.new_devices),
        }


def _split(layers: Sequence[tuple[int, int]], devices: Sequence[str]) -> str:
    named = devices if len(devices) == len(layers) else [""] * len(layers)
    return " / ".join(
        f"{a}-{b - 1}" + (f" on {d}" if d else "") for (a, b), d in zip(layers, named, strict=True)
    )


def predicted_step_s(plan: PlanFile) -> tuple[float, ...]:
    """Per stage, the plan's step time: its decode_ms (else prefill_ms, else 1 ms: equal stages)."""
    return tuple(
        (s.decode_ms if s.decode_ms else s.prefill_ms if s.prefill_ms else 1.0) / 1e3 for s in plan.stages
    )


def estimated_speeds(
    measured: Sequence[float], predicted: Sequence[float], assumed: Sequence[float]
) -> tuple[float, ...]:
    """Per stage, its device's speed as measured: assumed x min_j r_j / r_k with r = measured /
    predicted, scaled so the fastest stage is 1 (only relative speeds are observable)."""
    ratios = [m / p for m, p in zip(measured, predicted, strict=True)]
    floor = min(ratios)
    raw = [a * floor / r for a, r in zip(assumed, ratios, strict=True)]
    top = max(raw)
    return tuple(min(1.0, s / top) for s in raw)


@dataclass(frozen=True, slots=True)
class _Replanned:
    take: bool
    reason: str
    numbers: dict
    plan: PlanFile


@dataclass(slots=True)
class RemapDecider:
    """The decision loop's state: the plan in service, the speeds its devices are priced at,
    the last remap and the run of evaluations that wanted one."""

    plan: PlanFile
    cluster: Cluster  # the cluster the plan was made for (the speeds are relative to its devices)
    settings: RemapSettings = field(default_factory=RemapSettings)
    solver: str = "dp"
    time_limit_s: float = 10.0
    assumed: dict[str, float] = field(default_factory=dict)  # device -> priced speed (default 1)
    first_node: str | None = None  # where every new plan's first stage runs (a Ray pipeline's server)
    last_remap_s: float | None = None
    _wanted: tuple[tuple[int, int], ...] | None = None  # the split the last evaluations wanted
    _wanted_count: int = 0

    def evaluate(self, now_s: float, stats: WindowStats | None) -> RemapDecision:
        plan, settings = self.plan, self.settings
        old_layers = tuple((s.layer_start, s.layer_end) for s in plan.stages)
        if stats is None or len(stats.step_s) != len(plan.stages):
            reason = "no window of this pipeline yet"
            return RemapDecision(now_s, "insufficient", reason, old_layers=old_layers)
        short = [k for k, n in enumerate(stats.batches) if n < settings.min_batches]
        if short:
            reason = f"stage {short[0]} ran {stats.batches[short[0]]} of {settings.min_batches} micro-batches"
            return RemapDecision(now_s, "insufficient", reason, old_layers=old_layers)
        predicted = predicted_step_s(plan)
        assumed = [self.assumed.get(s.device, 1.0) for s in plan.stages]
        speeds = estimated_speeds(stats.step_s, predicted, assumed)
        numbers = {
            "measured_step_s": stats.step_s,
            "predicted_step_s": predicted,
            "old_layers": old_layers,
            "old_devices": tuple(s.device for s in plan.stages),
        }
        drifted = [k for k in range(len(speeds)) if _drifted(speeds[k], assumed[k], settings.min_slowdown)]
        workload, workload_note = self._workload(stats)
        if not drifted and workload is None:
            reason = f"every stage within {settings.min_slowdown:g}x of its assumed speed"
            return RemapDecision(now_s, "steady", reason, speeds=speeds, **numbers)
        notes = [f"stage {k} at {speeds[k]:.3g}x (assumed {assumed[k]:.3g}x)" for k in drifted]
        notes += [workload_note] if workload_note else []
        priced = tuple(speeds[k] if k in drifted else assumed[k] for k in range(len(speeds)))
        if self.last_remap_s is not None and now_s - self.last_remap_s < settings.cooldown_s:
            reason = f"{'; '.join(notes)}; within {settings.cooldown_s:g} s of the last remap"
            return RemapDecision(now_s, "cooldown", reason, speeds=priced, **numbers)
        device_speeds = {**self.assumed, **{s.device: v for s, v in zip(plan.stages, priced, strict=True)}}
        try:
            replanned = self._replan(device_speeds, workload)
        except TesselError as error:  # no plan for what was measured (the model does not fit it, ...)
            self._wanted, self._wanted_count = None, 0
            reason = f"{'; '.join(notes)}; re-planning found no plan: {error}"
            return RemapDecision(now_s, "kept", reason, speeds=priced, **numbers)
        numbers |= replanned.numbers
        if not replanned.take:
            self._wanted, self._wanted_count = None, 0
            reason = f"{'; '.join(notes)}; {replanned.reason}"
            return RemapDecision(now_s, "kept", reason, speeds=priced, **numbers)
        new_layers = numbers["new_layers"]
        self._wanted_count = self._wanted_count + 1 if self._wanted == new_layers else 1
        self._wanted = new_layers
        reason = f"{'; '.join(notes)}; {replanned.reason}"
        if self._wanted_count < settings.confirm:
            reason += f"; wanted by {self._wanted_count} of {settings.confirm} evaluations in a row"
            return RemapDecision(now_s, "unconfirmed", reason, speeds=priced, **numbers)
        return RemapDecision(now_s, "remap", reason, speeds=priced, new_plan=replanned.plan, **numbers)

    def evaluate_joined(self, now_s: float, joined: Sequence[str]) -> RemapDecision:
        """Machines `joined` the cluster (`self.cluster` now holds them): re-plan on it, the devices
        in service priced at their assumed speeds. A join is an event, not a noisy measurement: no
        confirmation and no cooldown, and the threshold and the move's cost decide."""
        plan = self.plan
        speeds = tuple(self.assumed.get(s.device, 1.0) for s in plan.stages)
        numbers = {
            "old_layers": tuple((s.layer_start, s.layer_end) for s in plan.stages),
            "old_devices": tuple(s.device for s in plan.stages),
            "speeds": speeds,
        }
        note = f"{', '.join(joined)} joined the cluster"
        try:
            replanned = self._replan(dict(self.assumed), None)
        except TesselError as error:
            return RemapDecision(now_s, "kept", f"{note}; re-planning found no plan: {error}", **numbers)
        numbers |= replanned.numbers
        if not replanned.take:
            return RemapDecision(now_s, "kept", f"{note}; {replanned.reason}", **numbers)
        reason = f"{note}; {replanned.reason}"
        return RemapDecision(now_s, "remap", reason, new_plan=replanned.plan, **numbers)

    def adopt(self, decision: RemapDecision, now_s: float) -> None:
        """The remap of `decision` is in service: its plan is what later windows are held against,
        its devices priced at the speeds it measured."""
        if decision.new_plan is None:
            raise ValueError("adopt() takes a decision with a new plan")
        self.assumed.update({s.device: v for s, v in zip(self.plan.stages, decision.speeds, strict=True)})
        self.plan = decision.new_plan
        self.last_remap_s = now_s
        self._wanted, self._wanted_count = None, 0

    def _workload(self, stats: WindowStats):
        """(the measured workload, why) when it drifted from the plan's by `workload_drift`; else
        (None, "")."""
        from tessel.plan.files.workload import parse_workload

        if stats.requests < self.settings.min_requests or stats.span_s < self.settings.window_s:
            return None, ""  # too few requests, or a window not yet full
        planned = plan_workload(self.plan)
        # what is known when a request arrives; output lengths (of the requests that finished in the
        # window: the short ones first) re-price a drifted workload but never trigger on their own
        pairs = {
            "arrival rate": (stats.arrival_rate_per_s, planned.arrival_rate_per_s),
            "mean prompt": (stats.mean_prompt_tokens, planned.prompt_tokens.mean_tokens),
        }
        moved = [
            f"{name} {got:.3g} (plan {want:.3g})"
            for name, (got, want) in pairs.items()
            if got and want and max(got / want, want / got) >= self.settings.workload_drift
        ]
        if not moved:
            return None, ""
        data = planned.model_dump()
        measured = {"prompt_tokens": stats.mean_prompt_tokens, "output_tokens": stats.mean_output_tokens}
        for key, mean in measured.items():
            if mean:  # the plan's longest lengths still size memory
                data[key] = {"mean": mean, "max": max(getattr(planned, key).max_tokens, math.ceil(mean))}
        if stats.arrival_rate_per_s and planned.arrival_rate_per_s is not None:
            data["arrival_rate_per_s"] = stats.arrival_rate_per_s
        return parse_workload(data, source="the measured workload"), "workload moved: " + ", ".join(moved)

    def _replan(self, device_speeds: dict[str, float], workload) -> _Replanned:
        from tessel.plan.api import PlanSettings, inherited_precisions, prepare_plan
        from tessel.plan.remap.replan import previous_solution, replan
        from tessel.plan.report import plan_json

        plan = self.plan
        workload = workload or plan_workload(plan)
        cluster = repriced_cluster(self.cluster, device_speeds)
        settings = PlanSettings.of_plan(plan, time_limit_s=self.time_limit_s, solver=self.solver)
        settings = inherited_precisions(settings, plan)
        problem = prepare_plan(plan.model_spec, cluster, workload, settings)
        previous = previous_solution(problem.instance, plan.stages, plan.source, plan.reference_dtype)
        decision = replan(
            problem.instance,
            cluster,
            previous,
            threshold=self.settings.threshold,
            horizon_s=self.settings.horizon_s,
            solver=self.solver,
            time_limit_s=self.time_limit_s,
            first_node=self.first_node,
        )
        new = decision.new
        new_plan = plan_json(
            problem.instance,
            new.evaluation,
            model=plan.model_spec,
            cluster=cluster,
            cluster_source=plan.cluster.source,
            workload=workload,
            solver={"name": new.solver, "status": new.status, "gap": new.gap, "time_s": new.time_s},
            baselines={},
            dtype=plan.dtype,
            kv_dtype=plan.kv_dtype,
            granularity=plan.granularity,
        )
        numbers = {
            "gain": float(decision.gain),
            "old_objective": decision.previous_evaluation.objective,
            "new_objective": new.evaluation.objective,
            "move_bytes": decision.move_bytes,
            "move_s": decision.move_s,
            "new_layers": tuple((s.layer_start, s.layer_end) for s in new_plan.stages),
            "new_devices": tuple(s.device for s in new_plan.stages),
        }
        return _Replanned(decision.take_new, decision.reason, numbers, new_plan)


def plan_workload(plan: PlanFile):
    """The workload the plan was made for (its file's fields; the bundled default when it has none)."""
    from tessel.plan.files.workload import Workload, load_workload, parse_workload

    fields = {k: v for k, v in plan.workload.items() if k in Workload.model_fields}
    if not fields:
        return load_workload("default")
    return parse_workload(fields, source=f"{plan.source} workload")


def _drifted(speed: float, assumed: float, min_slowdown: float) -> bool:
    return max(speed / assumed, assumed / speed) >= min_slowdown


def repriced_cluster(cluster: Cluster, speeds: dict[str, float]) -> Cluster:
    """`cluster` with each named device's FLOP/s and memory bandwidth scaled by its speed (its
    `emulate_speed` and schedule kept: they are what the runtime emulates, not what it measured)."""
    devices = tuple(
        replace(d, spec=d.spec.emulated(speeds[d.name])) if speeds.get(d.name, 1.0) < 1.0 else d
        for d in cluster.devices
    )
    return replace(cluster, devices=devices)
