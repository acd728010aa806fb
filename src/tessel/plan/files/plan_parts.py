"""The parts of a plan file (`tessel.plan.files.plan_file`, whose docstring gives the format and its
versions): a stage and its link, predicted figures, a baseline, a replica, a flow plan's placements
and edges, the quality record, the model and cluster references, and the rules they share (units per
layer, unit kinds, the reference precision, emulated speed schedules, a device's GPU index).

`PlanFile` is made of these; a reader of one part (a stage, a variant) imports it from here.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tessel.cost.layer import WEIGHT_SCHEMES, weight_param_bytes
from tessel.plan.files.workload import MAX_MICRO_BATCHES
from tessel.units import GBPS, US_PER_S

WEIGHT_RTOL = 1e-6  # replica weights must sum to 1 within this
MAX_INDEX = 2**31 - 1  # unit, layer and stage indices: far above any model, far below overflow
# The slowest emulated stage: at speed s a stage sleeps (1/s - 1) x its compute, so 0.01 is a stage
# 100x slower than measured; below it a run takes days (1e-9: a billion times its compute).
MIN_EMULATE_SPEED = 0.01
# The slowest emulated host link (Gbit/s), for streamed weights and swapped KV alike: 1 Mbit/s, a
# thousand times below PCIe 1.0 x1, leaves room for a CPU standing in for a GPU at the CPU's own
# break-even (benchmarks/offload.py's slow link is about 0.05); below it every copy waits for hours
# (1e-12: years per KiB).
MIN_EMULATE_HOST_GBPS = 1e-3
OFFLOAD_RTOL = 1e-6  # offloaded GiB may exceed host GiB by rounding only
MAX_SCHEDULE_CHANGES = 1000  # speed changes in one emulated schedule: a scenario, not a trace
# A device written as a torch device ("cuda:0", "cpu", "node/cuda:1"): its kind must agree with gpu_type.
TORCH_DEVICE = re.compile(r"(?:.*/)?(cuda|cpu|mps|xpu|hip)(?::\d+)?", re.IGNORECASE)
CPU_TYPE = "cpu"  # the catalog's gpu_type of a CPU device
MAX_TP_DEGREE = 8  # the largest tensor-parallel stage: one 8-GPU machine (tessel.cost.tensor_parallel)
GPU_INDEX = re.compile(r"/\D*(\d+)[^/]*$")  # a device name's GPU index: the first number after the node


def check_emulate_schedule(schedule: list | None) -> str | None:
    """Why an emulated speed schedule ([[seconds, speed], ...]) is not one (None: it is): at most
    MAX_SCHEDULE_CHANGES pairs, seconds >= 0 and strictly ascending, speeds in
    [MIN_EMULATE_SPEED, 1]."""
    if schedule is None:
        return None
    if len(schedule) > MAX_SCHEDULE_CHANGES:
        return f"{len(schedule)} speed changes; at most {MAX_SCHEDULE_CHANGES}"
    previous = -math.inf
    for position, pair in enumerate(schedule):
        if len(pair) != 2:
            return f"schedule[{position}] must be [seconds, speed], got {len(pair)} numbers"
        seconds, speed = pair
        if not (math.isfinite(seconds) and seconds >= 0 and seconds > previous):
            return f"schedule[{position}]: seconds {seconds:g} must be >= 0 and above the previous change's"
        if not (math.isfinite(speed) and MIN_EMULATE_SPEED <= speed <= 1):
            return f"schedule[{position}]: speed {speed:g} must be in [{MIN_EMULATE_SPEED:g}, 1]"
        previous = seconds
    return None


def emulated_speed_at(speed: float, schedule, elapsed_s: float) -> float:
    """The emulated speed `elapsed_s` seconds into serving: the last schedule change at or before
    then, else `speed` (the runtime's stage and the simulator read the schedule through this)."""
    for seconds, changed in schedule or ():
        if seconds > elapsed_s:
            break
        speed = changed
    return speed


def units_per_layer(granularity: str) -> int:
    """Units in one decoder layer: 1 at layer granularity, 2 (attention, MLP) at sublayer."""
    return 2 if granularity == "sublayer" else 1


def reference_precision(names: list[str] | tuple[str, ...]) -> str:
    """The precision with the most bytes per weight (fp16 before bf16 on a tie): the planner's
    reference, at which embedding, LM head and activations run (`tessel plan --precisions`)."""
    order = tuple(WEIGHT_SCHEMES)
    return min(names, key=lambda name: (-weight_param_bytes(name), order.index(name)))


def unknown_precision(names: list[str]) -> str | None:
    """Why a list of weight precisions is not one the cost model prices (None: it is)."""
    for position, name in enumerate(names):
        if name not in WEIGHT_SCHEMES:
            return (
                f"precisions[{position}] is {short_repr(name)}, not a weight precision the cost model "
                f"knows; use one of {', '.join(WEIGHT_SCHEMES)}"
            )
    return None


def unit_kind(unit: int, granularity: str) -> str:
    """'layer', or at sublayer granularity 'attention' (even units) or 'mlp' (odd units)."""
    if granularity != "sublayer":
        return "layer"
    return "attention" if unit % 2 == 0 else "mlp"


def gpu_index(device: str) -> int | None:
    """K of a plan's device name `<node>/gpu<K>` (or `<node>/gpu<K>#2`, the second name of one GPU
    that two stages share); None when it names none."""
    found = GPU_INDEX.search(device)
    return None if found is None else int(found.group(1))


def short_repr(value: Any, limit: int = 40) -> str:
    """`repr(value)`, cut to `limit` characters (what an error message quotes of a bad value)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class StrictModel(BaseModel):
    """A part of the plan file: frozen, strict types, unknown keys ignored, no inf or nan."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True, allow_inf_nan=False)


class Link(StrictModel):
    """The link from a stage to the next one (None fields: the plan was made without a cluster)."""

    bandwidth_gbps: float | None = Field(default=None, gt=0)  # gigabits per second
    latency_us: float | None = Field(default=None, ge=0)


class PlanStage(StrictModel):
    index: int = Field(ge=0, le=MAX_INDEX)
    device: str = Field(min_length=1)
    gpu_type: str = Field(min_length=1)
    node: str = ""
    layer_start: int = Field(ge=0, le=MAX_INDEX)  # half-open [layer_start, layer_end)
    layer_end: int = Field(ge=0, le=MAX_INDEX)
    unit_start: int = Field(ge=0, le=MAX_INDEX)  # half-open [unit_start, unit_end)
    unit_end: int = Field(ge=0, le=MAX_INDEX)
    weights_gib: float | None = Field(default=None, ge=0)
    kv_gib: float | None = Field(default=None, ge=0)  # KV the planner reserved (None: not given)
    offload_gib: float = Field(default=0.0, ge=0)  # held in host memory, streamed in every pass
    # KV under memory pressure (optional; absent in older plans): how the stage brings back evicted KV
    # ("swap": out to host and back; "recompute": prefill the context again), the part of offload_gib
    # that is evicted KV, and the device's host link the planner priced a swap with (Gbit/s)
    kv_preemption: Literal["swap", "recompute"] | None = None
    kv_evicted_gib: float = Field(default=0.0, ge=0)
    host_h2d_gbps: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    host_d2h_gbps: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _kv_evicted_within_offload(self) -> PlanStage:
        if self.kv_evicted_gib > self.offload_gib * (1 + 1e-6) + 1e-9:
            raise ValueError(
                f"stage {self.index}: kv_evicted_gib {self.kv_evicted_gib:.3f} is more than its "
                f"offload_gib {self.offload_gib:.3f} (evicted KV is part of what leaves the device)"
            )
        return self

    prefill_ms: float | None = Field(default=None, ge=0)
    decode_ms: float | None = Field(default=None, ge=0)
    link_to_next: Link | None = None
    emulate_speed: float = Field(default=1.0, gt=0, le=1)  # fraction of the host's speed (cluster `emulate`)
    precisions: list[str] | None = None  # weight precision of each unit, unit_start..unit_end (v2)
    # v5, tensor parallelism: the stage's degree and the GPU of each rank (rank 0 = `device`), and
    # the slowest link of its ring (all-reduces); absent: one GPU, `device` (tessel.plan.files.tp_checks)
    tp_degree: int = Field(default=1, ge=1, le=MAX_TP_DEGREE)
    gpus: list[str] | None = None
    tp_link: Link | None = None
    # emulated speed over serving time: [[seconds since the stage started serving, speed], ...]
    emulate_schedule: list[list[float]] | None = None
    # offloading the runtime performs (optional; `tessel.plan.streamed`): the decoder layers whose
    # weights stay in host memory and stream in before they run, the host memory the device may
    # offload into, and a CPU device's emulated memory and host link (cluster `emulate`)
    offload_layers: list[int] | None = None
    host_gib: float | None = Field(default=None, ge=0)
    emulate_memory_gib: float | None = None
    emulate_host_gbps: float | None = None  # gigabits per second, as every bandwidth in the file

    @field_validator("emulate_memory_gib", "emulate_host_gbps", mode="before")
    @classmethod
    def _positive_emulation(cls, value: Any, info: ValidationInfo) -> Any:
        memory = info.field_name == "emulate_memory_gib"
        what = "GiB of emulated device memory" if memory else f"Gbit/s, at least {MIN_EMULATE_HOST_GBPS:g}"
        number = isinstance(value, int | float) and not isinstance(value, bool)
        floor_ok = memory or (number and value >= MIN_EMULATE_HOST_GBPS)
        if value is not None and not (number and math.isfinite(value) and value > 0 and floor_ok):
            raise ValueError(
                f"{info.field_name} is {short_repr(value)}; it must be a positive number of {what}"
            )
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _offload(self) -> PlanStage:
        layers = self.offload_layers or []
        outside = [layer for layer in layers if not self.layer_start <= layer < self.layer_end]
        if outside:
            raise ValueError(
                f"stage {self.index}: offload_layers {outside[:3]} are not its layers "
                f"[{self.layer_start}, {self.layer_end})"
            )
        if layers != sorted(set(layers)):
            raise ValueError(f"stage {self.index}: offload_layers must ascend without repeats")
        return self

    def host_overflow(self) -> str | None:
        """Why this stage's offload does not fit its host memory (checked on runnable stages only:
        an infeasible baseline is recorded as it was priced), or None."""
        if self.host_gib is not None and self.offload_gib > self.host_gib * (1 + OFFLOAD_RTOL):
            return (
                f"stage {self.index} ({self.device}) offloads {self.offload_gib:.3f} GiB but its host "
                f"memory is {self.host_gib:.3f} GiB; give the node more host_memory_gib and plan again"
            )
        return None

    @field_validator("emulate_schedule")
    @classmethod
    def _schedule(cls, schedule: list[list[float]] | None) -> list[list[float]] | None:
        problem = check_emulate_schedule(schedule)
        if problem:
            raise ValueError(problem)
        return schedule

    @field_validator("emulate_speed")
    @classmethod
    def _emulate_floor(cls, speed: float) -> float:
        if speed < MIN_EMULATE_SPEED:
            raise ValueError(
                f"{speed:g} is below the slowest emulated speed {MIN_EMULATE_SPEED:g} (a stage "
                f"{1 / MIN_EMULATE_SPEED:g}x slower than measured); a slower one would run for days"
            )
        return speed

    @model_validator(mode="after")
    def _device_kind(self) -> PlanStage:
        """A device written as a torch device ("cuda:0", "cpu") names its kind: it must be gpu_type's."""
        match = TORCH_DEVICE.fullmatch(self.device)
        if match is None:
            return self
        on_cpu = match.group(1).lower() == CPU_TYPE
        if on_cpu != (self.gpu_type.lower() == CPU_TYPE):
            raise ValueError(
                f"device {short_repr(self.device)} is a {match.group(1)} device but "
                f"its gpu_type is {short_repr(self.gpu_type)}; the runtime places a stage by gpu_type, "
                "so make them agree"
            )
        return self

    @model_validator(mode="after")
    def _precision_count(self) -> PlanStage:
        if self.precisions is None:
            return self
        if len(self.precisions) != self.unit_end - self.unit_start:
            raise ValueError(
                f"stage {self.index}: {len(self.precisions)} precisions for "
                f"{self.unit_end - self.unit_start} units"
            )
        unknown = unknown_precision(self.precisions)
        if unknown:
            raise ValueError(f"stage {self.index} ({self.device}): {unknown}")
        return self

    def unit_precisions(self, default: str) -> tuple[str, ...]:
        """The weight precision of each of its units (`default` for all when the plan gives none)."""
        if self.precisions is None:
            return (default,) * (self.unit_end - self.unit_start)
        return tuple(self.precisions)

    @property
    def rank_gpus(self) -> tuple[str, ...]:
        """The GPU of each tensor-parallel rank (one GPU: `device`)."""
        return tuple(self.gpus) if self.gpus else (self.device,)

    @property
    def tp_link_spec(self):  # -> tessel.cost.link.LinkSpec | None
        """The ring's link of a tensor-parallel stage (None at degree 1 or when not recorded)."""
        from tessel.cost.link import LinkSpec

        link = self.tp_link
        if self.tp_degree == 1 or link is None or link.bandwidth_gbps is None:
            return None
        return LinkSpec(link.bandwidth_gbps * GBPS, (link.latency_us or 0.0) / US_PER_S)

    @property
    def label(self) -> str:
        return f"{self.device} ({self.gpu_type}) L{self.layer_start}-{self.layer_end - 1}"

    @property
    def link_bytes_per_s(self) -> float | None:
        """Bandwidth of the link to the next stage in bytes/s; None on the last stage or when unknown."""
        if self.link_to_next is None or self.link_to_next.bandwidth_gbps is None:
            return None
        return self.link_to_next.bandwidth_gbps * GBPS

    @property
    def link_latency_s(self) -> float:
        if self.link_to_next is None or self.link_to_next.latency_us is None:
            return 0.0
        return self.link_to_next.latency_us / US_PER_S


class Predicted(StrictModel):
    ttft_s: float | None = None
    tpot_s: float | None = None
    throughput_tok_s: float | None = None  # the objective's figure: the pipeline fill paid every round
    # the steady state under continuous batching, no fill per round (`tessel.plan.steady_state`);
    # None in files written before it
    steady_state_tok_s: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {key: value for key, value in self.model_dump().items() if value is not None}


class Baseline(StrictModel):
    feasible: bool = False
    reason: str | None = None
    objective: float | None = None
    predicted: Predicted | None = None
    stages: list[PlanStage] | None = None


class Replica(StrictModel):
    """One of several pipelines (v2): its stages and the share of requests routed to it."""

    index: int = Field(ge=0, le=MAX_INDEX)
    weight: float = Field(gt=0, le=1)
    stages: list[PlanStage] = Field(min_length=1)
    predicted: Predicted | None = None
    objective: float | None = None
    # its share of the workload's m micro-batches in flight (None: written before shares, all m)
    micro_batches: int | None = Field(default=None, ge=1, le=MAX_MICRO_BATCHES)
    # v4, a path of a flow plan: per stage, the share of its device's time this path gets
    time_shares: list[float] | None = None

    @field_validator("time_shares")
    @classmethod
    def _shares(cls, shares: list[float] | None) -> list[float] | None:
        if shares is not None and any(not (0 < x <= 1 + WEIGHT_RTOL) for x in shares):
            raise ValueError("time_shares must each be in (0, 1]")
        return shares


class Placement(StrictModel):
    """One device's range in a flow plan (v4)."""

    device: str = Field(min_length=1)
    gpu_type: str = ""
    node: str = ""
    layer_start: int = Field(ge=0, le=MAX_INDEX)
    layer_end: int = Field(ge=0, le=MAX_INDEX)
    unit_start: int = Field(ge=0, le=MAX_INDEX)
    unit_end: int = Field(ge=0, le=MAX_INDEX)


class FlowEdge(StrictModel):
    """An edge of the placement graph and the share of all requests on it (v4)."""

    source: str = Field(min_length=1)  # "source" or a device
    target: str = Field(min_length=1)  # "sink" or a device
    weight: float = Field(gt=0, le=1 + WEIGHT_RTOL)


class Flow(StrictModel):
    """A flow plan's placements and flow weights (v4)."""

    placements: list[Placement] = Field(min_length=1)
    edges: list[FlowEdge] = Field(min_length=1)


def whole_predicted(replicas: list[Replica]) -> Predicted | None:
    """A replica plan's predicted figures for the whole plan (the top-level `predicted`, version 3).

    - throughput_tok_s: what the replicas serve together when requests are routed by their
      weights w_r: min_r X_r / w_r, the rate at which the first replica saturates. With the
      planner's weights (w_r = X_r / sum X) that is sum_r X_r, the max flow `tessel plan
      --replicas` reports as the total.
    - steady_state_tok_s: the same rule over the replicas' steady-state figures Y_r, min_r Y_r / w_r
      (the weights stay the planner's, so it is at most sum_r Y_r).
    - ttft_s, tpot_s: request-weighted means over the replicas, sum_r w_r x_r (a share w_r of the
      requests sees replica r's figure): what the mean request sees.

    A figure that some replica does not give is None; None when no figure is known."""
    figures = {}
    for key in Predicted.model_fields:
        values = [getattr(r.predicted, key) if r.predicted is not None else None for r in replicas]
        if not replicas or any(value is None for value in values):
            figures[key] = None
        elif key in ("throughput_tok_s", "steady_state_tok_s"):
            figures[key] = min(value / r.weight for value, r in zip(values, replicas, strict=True))
        else:
            figures[key] = sum(value * r.weight for value, r in zip(values, replicas, strict=True))
    return None if all(value is None for value in figures.values()) else Predicted(**figures)


class Quality(StrictModel):
    """The plan's quality cost (v2): its total, the budget and theta it was held to, the source."""

    cost: float = Field(ge=0)
    budget: float | None = Field(default=None, ge=0)  # None: unbounded
    theta: float = Field(default=0.0, ge=0)
    source: str = ""  # "shape", "weights" or "sensitivity"


class ModelRef(StrictModel):
    name: str = Field(min_length=1)
    config: dict[str, Any] | None = None  # ModelSpec fields (what `tessel plan` writes) or an HF config


class ClusterRef(StrictModel):
    name: str = "?"
    source: str = ""  # the cluster file or bundled name the plan was made for


class PlanVariant(BaseModel):
    """The main plan or one feasible baseline: a name and its stages in pipeline order."""

    model_config = ConfigDict(frozen=True)

    name: str
    stages: tuple[PlanStage, ...]
    predicted: dict[str, float] = {}  # ttft_s, tpot_s, throughput_tok_s where given
