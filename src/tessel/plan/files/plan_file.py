"""The plan file (`tessel plan --json`): one model that writes it and reads it (its parts, a stage, a
replica, a flow's placements, are in `tessel.plan.files.plan_parts`).

`tessel plan` writes it; `tessel chunk`, `tessel simulate`, `tessel plan --replan-from` and the
pipeline runtime read it, all through `load_plan`. A plan holds the chosen pipeline's stages (in
order, each a half-open run of units on one device) and, under `baselines`, the stages of each
baseline split when it was feasible.

Units: at `layer` granularity unit u is decoder layer u; at `sublayer` granularity unit 2i is layer
i's attention block and 2i + 1 its MLP block (a layer split mid-way belongs to two stages).

Versions: `PLAN_VERSION` is what this code writes; `SUPPORTED_VERSIONS` what it reads. An older
version is upgraded to the current one in `_upgrade`, the one place that knows old layouts.

Version 2 adds, all optional (a version 1 file reads as a version 2 file without them):
- `precisions` (the weight precisions the planner could choose from) and `quality` (the plan's total
  quality cost, the budget, theta and where the per-layer costs came from);
- per stage, `precisions`: the weight precision of each of its units, in unit order;
- `replicas`: several pipelines on disjoint devices, each with its stages, its routing `weight`
  (the share of requests a load balancer sends it; the weights sum to 1), its prediction and, optional,
  `micro_batches`: its share of the workload's m micro-batches in flight (the shares sum to at most m;
  absent in files written before shares: all m). The top-level `stages` are then the first
  replica's, so a reader of one pipeline still finds one.

Version 3 changes what the top-level `predicted` of a replica plan means: it is the whole plan's
(`whole_predicted`: what the replicas serve together under their routing weights), where versions
1 and 2 wrote replica 0's. Each replica keeps its own `predicted`. `_upgrade` recomputes the
top-level figures of an older replica plan from its replicas' (null where a replica gives none).
A plan without replicas is the same in every version.

Stages may also carry, optional in version 3 (a file without them runs nothing from host memory):
`offload_layers` (the decoder layers whose weights the runtime keeps in host memory and streams in,
`tessel.plan.streamed`), `host_gib` (the host memory the device may offload into: `offload_gib`
above it is refused) and a CPU device's emulation of a smaller device, `emulate_memory_gib` and
`emulate_host_gbps` (cluster `emulate: {memory_gib, host_gbps}`).

Version 4 adds `flow` (optional; older files read without it): a flow plan over placements
(`tessel.plan.flow.flow`). `flow.placements` gives each device's one range; `flow.edges` the share of
all requests on each edge of the placement graph ("source" into a device whose range starts at
unit 0, "sink" out of one whose range ends at the last unit, else device to device where one range
ends and the next starts). The `replicas` are then the paths requests take (they may share
devices; each stage's range is its device's placement) with their routing weights, micro-batches
and, per stage, `time_shares`: the share of the device's time the path gets. Refused: edge weights
out of the source or into the sink that do not sum to 1, a device whose edges in and out differ,
edges that are not the paths' sums, and placements with no path from the first layer to the last
(the message names the layer range).

Version 5 adds tensor-parallel stages (issue 45), optional per stage (older files read as degree 1):
`tp_degree` (1, 2, 4 or 8), `gpus` (one GPU name per rank, rank 0 first and equal to `device`; all
on one machine, of one type) and `tp_link` (the slowest link of the stage's ring, `bandwidth_gbps`
and `latency_us`, what its all-reduces are priced on). Structure is checked on load (count of
`gpus`, a GPU named twice anywhere, degrees dividing the model's heads and KV heads), the cluster
(machines, types, counts) by `check_cluster`: both in `tessel.plan.files.tp_checks`.
"""

from __future__ import annotations

import json
import math
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, model_validator

from tessel.errors import TesselError
from tessel.plan.files.plan_parts import (
    WEIGHT_RTOL,
    Baseline,
    ClusterRef,
    Flow,
    ModelRef,
    Placement,
    PlanStage,
    PlanVariant,
    Predicted,
    Quality,
    Replica,
    StrictModel,
    reference_precision,
    short_repr,
    unit_kind,
    units_per_layer,
    unknown_precision,
    whole_predicted,
)
from tessel.plan.files.workload import MAX_MICRO_BATCHES

if TYPE_CHECKING:
    from tessel.catalog.models import ModelSpec
    from tessel.plan.files.cluster import Cluster

PLAN_VERSION = 5
SUPPORTED_VERSIONS = frozenset({1, 2, 3, 4, 5})
WHOLE_PREDICTED_VERSION = 3  # from it, a replica plan's top-level `predicted` is the whole plan's
FLOW_WEIGHT_ATOL = 1e-5  # flow weights (written rounded to 9 digits) must balance within this
MAIN_VARIANT = "plan"
MAX_PLAN_BYTES = 64 * 2**20  # a plan of 10,000 stages is a few MB
MAX_NESTING = 32  # a plan's deepest part (a baseline's stage link) is 5 levels down
# Workload keys a runtime sizes by (micro-batches in flight): at most what the planner accepts
# (`tessel.plan.files.workload.MAX_MICRO_BATCHES`, a workload file's `max_micro_batch`).
MICRO_BATCH_KEYS = ("m", "max_micro_batch")


class PlanFile(StrictModel):
    version: int
    model: ModelRef
    cluster: ClusterRef = ClusterRef()
    workload: dict[str, Any] = {}
    dtype: str = "fp16"
    kv_dtype: str = "fp16"
    granularity: Literal["layer", "sublayer"] = "layer"
    overlap: bool = False
    swap_in: str = "charged"
    stages: list[PlanStage] = Field(min_length=1)
    predicted: Predicted | None = None
    objective: float | None = None
    solver: dict[str, Any] = {}
    baselines: dict[str, Baseline] = {}
    precisions: list[str] = []  # v2: precisions the planner chose from (empty: `dtype` throughout)
    quality: Quality | None = None  # v2
    replicas: list[Replica] = []  # v2: several pipelines (empty: the one in `stages`)
    flow: Flow | None = None  # v4: placements and flow weights; `replicas` are then its paths
    _source: str = PrivateAttr(default="<plan>")

    @model_validator(mode="before")
    @classmethod
    def _upgraded(cls, data: Any) -> Any:
        return _upgrade(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _consistent(self) -> PlanFile:
        unknown = unknown_precision(self.precisions)
        if unknown:
            raise ValueError(unknown)
        _check_micro_batches(self.workload)
        _check_stages(self.stages, "stages", self.granularity)
        for name, baseline in self.baselines.items():
            if baseline.feasible and baseline.stages:
                _check_stages(baseline.stages, f"baselines.{name}.stages", self.granularity)
        _check_flow(self)
        _check_replicas(self)
        from tessel.plan.files.tp_checks import tp_problems

        problems = tp_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ---- writing -------------------------------------------------------------------------------

    def dump(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    def write(self, path: str | Path) -> None:
        """Write the plan to `path` atomically (the previous file stays until the new one is complete)."""
        from tessel.files import write_text_file

        write_text_file(path, self.dump(), "plan file")

    # ---- derived facts -------------------------------------------------------------------------

    @property
    def source(self) -> str:
        return self._source

    @property
    def path(self) -> str:
        return self.source

    @property
    def units_per_layer(self) -> int:
        return units_per_layer(self.granularity)

    def unit_kind(self, unit: int) -> str:
        return unit_kind(unit, self.granularity)

    @property
    def reference_dtype(self) -> str:
        """The precision of what has none of its own (embedding, LM head, activations, units of a
        stage without `precisions`): the planner's reference, first of `precisions`, else `dtype`."""
        return reference_precision(self.precisions) if self.precisions else self.dtype

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layer_end

    @property
    def num_units(self) -> int:
        return self.stages[-1].unit_end

    def stage_of_layer(self, layer: int) -> PlanStage:
        """The stage holding the layer's first unit (its attention block at sublayer granularity)."""
        unit = layer * self.units_per_layer
        for stage in self.stages:
            if stage.unit_start <= unit < stage.unit_end:
                return stage
        raise TesselError(
            f"{self.source}: layer {layer} is not in the plan (it has {self.num_layers} layers)"
        )

    @property
    def model_name(self) -> str:
        return self.model.name

    @property
    def cluster_name(self) -> str:
        return self.cluster.name

    @cached_property
    def model_spec(self) -> ModelSpec:
        """The plan's model: `model.config` as ModelSpec fields or as an HF config.json, else the
        catalog preset `model.name`. Parsed once."""
        from dataclasses import fields

        from tessel.catalog.models import ModelSpec, load_model, model_from_config

        config = self.model.config
        if config and "num_layers" in config:
            names = {f.name for f in fields(ModelSpec)}
            try:
                return ModelSpec(**{key: value for key, value in config.items() if key in names})
            except (TypeError, ValueError) as error:
                raise TesselError(
                    f"{self.source}: model.config is not a valid model spec ({error})"
                ) from None
        if config:
            return model_from_config(config, name=self.model.name, source=f"{self.source} model.config")
        return load_model(self.model.name)

    @property
    def main(self) -> PlanVariant:
        """The top-level pipeline. In a replica plan its stages are replica 0's, and so are the
        figures it carries (the whole plan's are `predicted`)."""
        predicted = self.replicas[0].predicted if self.replicas else self.predicted
        return PlanVariant(name=MAIN_VARIANT, stages=tuple(self.stages), predicted=_predicted(predicted))

    @property
    def baseline_variants(self) -> tuple[PlanVariant, ...]:
        """Feasible baselines with stages, in file order."""
        return tuple(
            PlanVariant(name=name, stages=tuple(b.stages), predicted=_predicted(b.predicted))
            for name, b in self.baselines.items()
            if b.feasible and b.stages
        )

    @property
    def replica_variants(self) -> tuple[PlanVariant, ...]:
        """The replicas (v2) as pipelines named replica0, replica1, ... (empty: one pipeline)."""
        return tuple(
            PlanVariant(name=f"replica{r.index}", stages=tuple(r.stages), predicted=_predicted(r.predicted))
            for r in self.replicas
        )

    @property
    def variants(self) -> tuple[PlanVariant, ...]:
        return (self.main, *self.baseline_variants)

    @property
    def infeasible(self) -> dict[str, str]:
        """Baseline name -> why it has no plan."""
        return {
            name: b.reason or "no feasible split"
            for name, b in self.baselines.items()
            if not (b.feasible and b.stages)
        }

    def check_cluster(self, cluster: Cluster) -> None:
        """Every stage's device exists in `cluster` with the plan's GPU type (no device twice is
        checked on load)."""
        for variant in (*self.variants, *self.replica_variants):
            for position, stage in enumerate(variant.stages):
                where = f"{self.source}: {_where(variant)}[{position}]"
                names = [device.name for device in cluster.devices]
                if stage.device not in names:
                    raise TesselError(
                        f"{where}: device {stage.device!r} is not in cluster {cluster.name} "
                        f"(devices: {', '.join(names)}); plan again for this cluster"
                    )
                actual = cluster.device(stage.device).gpu_type
                if actual.lower() != stage.gpu_type.lower():
                    raise TesselError(
                        f"{where}: device {stage.device!r} is a {stage.gpu_type} in the plan but a "
                        f"{actual} in cluster {cluster.name}; plan again for this cluster"
                    )

        from tessel.plan.files.tp_checks import check_tp_stages

        check_tp_stages(self, cluster=cluster)

    def check_named_cluster(self) -> None:
        """`check_cluster` against the cluster the plan names, when that can be found (a bundled
        name or a cluster file); a hand-written plan naming no known cluster is not checked."""
        cluster = self.named_cluster()
        if cluster is not None:
            self.check_cluster(cluster)

    def named_cluster(self) -> Cluster | None:
        """The cluster the plan names, when that can be found (a bundled name or a cluster file)."""
        from tessel.plan.files.cluster import list_bundled_clusters, load_cluster

        source = self.cluster.source or self.cluster.name
        try:
            found = source in list_bundled_clusters() or Path(source).is_file()
        except (OSError, ValueError):  # a name no file system accepts (NUL bytes, too long)
            found = False
        return load_cluster(source) if found else None

    def check_model(self, name: str, num_layers: int) -> None:
        """The model a runtime is about to load is the plan's (same name and layer count)."""
        differences = []
        if name != self.model.name:
            differences.append(f"model {name!r}, the plan is for {self.model.name!r}")
        if num_layers != self.num_layers:
            differences.append(f"{num_layers} layers, the plan covers {self.num_layers}")
        if differences:
            raise TesselError(f"{self.source}: " + "; ".join(differences) + "; plan again for this model")


def _check_micro_batches(workload: dict[str, Any]) -> None:
    """`workload.m` and `workload.max_micro_batch`, where given, are whole numbers of micro-batches
    from 1 to MAX_MICRO_BATCHES (a runtime keeps that many in flight and sizes its buffers by it)."""
    for key in MICRO_BATCH_KEYS:
        value = workload.get(key)
        if value is None:
            continue
        if type(value) is not int or not 1 <= value <= MAX_MICRO_BATCHES:
            raise ValueError(
                f"workload.{key} is {short_repr(value)}; micro-batches in flight must be a whole number "
                f"from 1 to {MAX_MICRO_BATCHES} (what `tessel plan` accepts as max_micro_batch)"
            )


def _check_replicas(plan: PlanFile) -> None:
    """Each replica's stages are a pipeline over all units, no device serves two replicas, the
    weights sum to 1, the top-level stages are the first replica's, and the replicas' shares of the
    in-flight micro-batches sum to at most the workload's m."""
    if not plan.replicas:
        return
    owner: dict[str, int] = {}
    for position, replica in enumerate(plan.replicas):
        _check_stages(replica.stages, f"replicas[{position}].stages", plan.granularity)
        if replica.stages[-1].unit_end != plan.stages[-1].unit_end:
            raise ValueError(f"replicas[{position}] covers {replica.stages[-1].unit_end} units, not all")
        for stage in replica.stages:
            if stage.device in owner and plan.flow is None:
                raise ValueError(
                    f"device {stage.device!r} serves replicas {owner[stage.device]} and {position}"
                )
            owner[stage.device] = position
    total = sum(replica.weight for replica in plan.replicas)
    if abs(total - 1.0) > WEIGHT_RTOL:
        raise ValueError(f"replica weights sum to {total:.6g}, not 1")
    if [s.device for s in plan.replicas[0].stages] != [s.device for s in plan.stages]:
        raise ValueError("'stages' must be the first replica's stages")
    shares = [r.micro_batches for r in plan.replicas if r.micro_batches is not None]
    m = plan.workload.get("m") if isinstance(plan.workload, dict) else None
    if isinstance(m, int) and sum(shares) > m:
        raise ValueError(
            f"replicas hold {sum(shares)} micro-batches in flight, more than the workload's m={m}"
        )


def _check_flow(plan: PlanFile) -> None:
    """A flow plan's placements, edges and paths agree (see the module docstring)."""
    flow = plan.flow
    if flow is None:
        return
    if not plan.replicas:
        raise ValueError("a flow plan lists its paths under 'replicas'")
    ranges: dict[str, Placement] = {}
    for position, p in enumerate(flow.placements):
        if p.unit_end <= p.unit_start or p.layer_end <= p.layer_start:
            raise ValueError(f"flow.placements[{position}] holds no units")
        if p.device in ranges:
            raise ValueError(f"flow.placements: device {p.device!r} placed twice")
        ranges[p.device] = p
    n_units = plan.stages[-1].unit_end
    _check_reaches_last_layer(list(ranges.values()), n_units, units_per_layer(plan.granularity))
    out: dict[str, float] = {}
    into: dict[str, float] = {}
    for position, e in enumerate(flow.edges):
        where = f"flow.edges[{position}] ({e.source} -> {e.target})"
        start = 0
        if e.source != "source":
            if e.source not in ranges:
                raise ValueError(f"{where}: {e.source!r} is not a placed device")
            start = ranges[e.source].unit_end
        if e.target == "sink":
            if start != n_units:
                raise ValueError(f"{where}: only a range ending at the last unit goes to the sink")
        elif e.target not in ranges:
            raise ValueError(f"{where}: {e.target!r} is not a placed device")
        elif ranges[e.target].unit_start != start:
            raise ValueError(
                f"{where}: the ranges do not meet (one ends at unit {start}, the next starts at "
                f"{ranges[e.target].unit_start})"
            )
        out[e.source] = out.get(e.source, 0.0) + e.weight
        into[e.target] = into.get(e.target, 0.0) + e.weight
    for end, total in (("source", out.get("source", 0.0)), ("sink", into.get("sink", 0.0))):
        if abs(total - 1.0) > FLOW_WEIGHT_ATOL:
            raise ValueError(f"flow weights at the {end} sum to {total:.6g}, not 1")
    for device in ranges:
        if abs(out.get(device, 0.0) - into.get(device, 0.0)) > FLOW_WEIGHT_ATOL:
            raise ValueError(
                f"flow weights into {device!r} ({into.get(device, 0.0):.6g}) and out of it "
                f"({out.get(device, 0.0):.6g}) differ"
            )
    on_edges: dict[tuple[str, str], float] = {}
    for position, replica in enumerate(plan.replicas):
        hops = ["source", *(s.device for s in replica.stages), "sink"]
        for a, b in zip(hops, hops[1:], strict=False):
            on_edges[(a, b)] = on_edges.get((a, b), 0.0) + replica.weight
        for stage in replica.stages:
            placed = ranges.get(stage.device)
            if placed is None or (placed.unit_start, placed.unit_end) != (stage.unit_start, stage.unit_end):
                raise ValueError(f"replicas[{position}]: {stage.device!r} is not on its placement's range")
        if replica.time_shares is not None and len(replica.time_shares) != len(replica.stages):
            raise ValueError(
                f"replicas[{position}]: {len(replica.time_shares)} time_shares for "
                f"{len(replica.stages)} stages"
            )
    given = {(e.source, e.target): e.weight for e in flow.edges}
    for key in sorted(set(given) | set(on_edges)):
        if abs(given.get(key, 0.0) - on_edges.get(key, 0.0)) > FLOW_WEIGHT_ATOL:
            raise ValueError(
                f"flow weight {key[0]} -> {key[1]} is {given.get(key, 0.0):.6g} but the paths routed over "
                f"it sum to {on_edges.get(key, 0.0):.6g}"
            )


def _check_reaches_last_layer(placements: list[Placement], n_units: int, per_layer: int) -> None:
    """Refuse placements with no path from unit 0 to the last unit, naming the layers."""
    starts: dict[int, list[int]] = {}
    held: set[int] = set()
    for p in placements:
        starts.setdefault(p.unit_start, []).append(p.unit_end)
        held.update(range(p.unit_start, p.unit_end))
    reach, todo = {0}, [0]
    while todo:
        for end in starts.get(todo.pop(), ()):
            if end not in reach:
                reach.add(end)
                todo.append(end)
    if n_units in reach:
        return
    first = max(u for u in reach if u < n_units)
    if first not in held:
        last = first
        while last + 1 < n_units and last + 1 not in held:
            last += 1
        why = "no GPU holds"
    else:
        last, why = n_units - 1, "no chain of GPU ranges reaches from layer 0 through"
    a, b = first // per_layer, last // per_layer
    span = f"layer {a}" if a == b else f"layers {a}-{b}"
    raise ValueError(f"the placement graph has no path from the first layer to the last: {why} {span}")


def _where(variant: PlanVariant) -> str:
    if variant.name.startswith("replica") and variant.name[len("replica") :].isdigit():
        return f"replicas[{variant.name[len('replica') :]}].stages"
    return "stages" if variant.name == MAIN_VARIANT else f"baselines.{variant.name}.stages"


def _predicted(predicted: Predicted | None) -> dict[str, float]:
    return {} if predicted is None else predicted.as_dict()


def _upgrade(data: dict) -> dict:
    """The one place older plan versions become the current one: version 1 lacks only optional
    version 2 fields (precisions, quality, replicas), so it reads as version 2 without them; a
    version 1 or 2 replica plan's top-level `predicted` (replica 0's) becomes the whole plan's,
    recomputed from its replicas (`whole_predicted`)."""
    _check_nesting(data)
    version = data.get("version")
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_VERSIONS))
        shown = "missing" if version is None else short_repr(version)
        raise ValueError(
            f"plan version {shown} is not supported; this tessel reads version {supported} "
            "(re-run `tessel plan --json` with this tessel)"
        )
    stages = data.get("stages")
    if not isinstance(stages, list) or not stages:
        raise ValueError("'stages' must be a non-empty list of stages")
    if version == 1:
        data = {key: value for key, value in data.items() if key not in ("precisions", "quality", "replicas")}
    if version < WHOLE_PREDICTED_VERSION and data.get("replicas"):
        data = {**data, "predicted": _whole_predicted_of(data["replicas"])}
    return {**data, "version": PLAN_VERSION}


def _whole_predicted_of(replicas: Any) -> dict[str, Any] | None:
    """The whole plan's figures from an older file's replicas, as JSON; None when its replicas do
    not parse (validation then refuses them with a message naming the field)."""
    if not isinstance(replicas, list):
        return None
    try:
        parsed = [Replica.model_validate(replica) for replica in replicas]
    except ValidationError:
        return None
    whole = whole_predicted(parsed)
    return None if whole is None else whole.model_dump()


def _check_nesting(data: Any) -> None:
    """Refuse JSON nested deeper than MAX_NESTING (free-form parts such as `workload` could hold
    anything; serialising them again must not recurse without bound). Iterative: no recursion."""
    pending = [(data, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_NESTING:
            raise ValueError(f"nested deeper than {MAX_NESTING} levels; not a plan file")
        if isinstance(value, dict):
            pending.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            pending.extend((item, depth + 1) for item in value)


def _check_stages(stages: list[PlanStage], where: str, granularity: str) -> None:
    """Stages cover units 0..n in order without gaps or overlaps; layers agree with units; no
    device holds two stages."""
    per = units_per_layer(granularity)
    seen: dict[str, int] = {}
    expected_unit = 0
    for position, stage in enumerate(stages):
        key = f"{where}[{position}]"
        overflow = stage.host_overflow()
        if overflow:
            raise ValueError(f"{key}: {overflow}")
        if stage.unit_end <= stage.unit_start:
            raise ValueError(f"{key} holds no units ({stage.unit_start}..{stage.unit_end})")
        if stage.layer_end <= stage.layer_start:
            raise ValueError(f"{key} holds no layers ({stage.layer_start}..{stage.layer_end})")
        if stage.unit_start != expected_unit:
            relation = "overlaps" if stage.unit_start < expected_unit else "leaves a gap after"
            raise ValueError(
                f"'{where}' is not contiguous: {key} starts at unit {stage.unit_start}, which "
                f"{relation} the previous stage (ending at unit {expected_unit})"
            )
        layers = (stage.unit_start // per, math.ceil(stage.unit_end / per))
        if (stage.layer_start, stage.layer_end) != layers:
            raise ValueError(
                f"{key}: layers [{stage.layer_start}, {stage.layer_end}) do not match units "
                f"[{stage.unit_start}, {stage.unit_end}) at {granularity} granularity "
                f"(expected layers [{layers[0]}, {layers[1]}))"
            )
        if stage.device in seen:
            raise ValueError(
                f"device {stage.device!r} holds two stages ({where}[{seen[stage.device]}] and {key}); "
                "a device runs one stage"
            )
        seen[stage.device] = position
        expected_unit = stage.unit_end


# ---- reading ------------------------------------------------------------------------------------


def load_plan(path: str | Path) -> PlanFile:
    """The one reader of plan files: a `TesselError` naming the file and the field for anything
    that is not a plan this version of tessel understands."""
    path = Path(path)
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise TesselError(f"{path}: not valid JSON (line {error.lineno}: {error.msg})") from None
    except RecursionError:
        raise TesselError(f"{path}: not a plan file (JSON nested too deeply)") from None
    return parse_plan(data, source=str(path))


def parse_plan(data: Any, *, source: str = "<plan>") -> PlanFile:
    """A plan from an already-parsed JSON document."""
    if not isinstance(data, dict):
        raise TesselError(f"{source}: a plan file holds a JSON object, not {type(data).__name__}")
    try:
        plan = PlanFile.model_validate(data)
    except ValidationError as error:
        raise TesselError(_clean(f"{source}: malformed plan: {_describe(error)}")) from None
    except RecursionError:
        raise TesselError(f"{source}: not a plan file (JSON nested too deeply)") from None
    plan._source = source
    return plan


def _read_text(path: Path) -> str:
    try:
        if path.is_dir():
            raise TesselError(
                f"{path} is a directory, not a plan file (pass the JSON from `tessel plan --json`)"
            )
        if not path.exists():
            raise TesselError(f"plan file {path} does not exist (write one with `tessel plan --json`)")
        if path.is_file() and path.stat().st_size > MAX_PLAN_BYTES:
            raise TesselError(f"{path}: {path.stat().st_size} bytes is too large for a plan file")
        raw = path.read_bytes()
    except OSError as error:
        raise TesselError(f"cannot read plan file {path}: {error.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TesselError(
            f"{path}: not a plan file (not UTF-8 text at byte {error.start}); "
            "pass the JSON from `tessel plan --json`"
        ) from None


def _describe(error: ValidationError) -> str:
    item = error.errors(include_url=False)[0]
    loc = _loc(item["loc"])
    if item["type"] == "missing":
        parent, _, field = loc.rpartition(".")
        return f"{parent} lacks {field!r}" if parent else f"lacks {field!r}"
    if item["type"] == "value_error":
        message = str(item.get("ctx", {}).get("error", item["msg"]))
        return f"{loc}: {message}" if loc else message
    return f"{loc}: {item['msg']}" if loc else item["msg"]


def _loc(parts: tuple) -> str:
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _clean(message: str) -> str:
    """Lone surrogates (from JSON escapes) cannot be printed: escape them."""
    return message.encode("utf-8", "backslashreplace").decode("utf-8")
