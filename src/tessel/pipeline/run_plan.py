"""The plan as the pipeline runtime reads it: one adapter over the plan-file model.

`load_run_plan(path)` is the only place `tessel.pipeline` reads a plan file. It returns the stages in
pipeline order (layer range, device, emulated speed), the model the plan was made for and how many
micro-batches to keep in flight, and `check_model` refuses a plan that does not fit the checkpoint
before any process starts. Every plan runs as paths over its stage processes (`tessel.pipeline.flow`):
a pipeline plan is one path through its stages; a flow plan (v4) runs one process per placement, its
`stages` the placements and its paths the routes over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tessel.chunk.latency import PipelineLatency
from tessel.cost.layer import FLOAT_WEIGHTS
from tessel.errors import TesselError
from tessel.plan.files.plan_file import PlanFile, load_plan
from tessel.plan.files.plan_parts import CPU_TYPE, PlanStage, gpu_index

PIPELINE_MIN_MICRO_BATCHES = 2  # without a plan workload: enough to keep two stages busy


@dataclass(frozen=True, slots=True)
class RunStage:
    index: int
    device: str  # the plan's device name (e.g. localhost/gpu0)
    gpu_type: str  # catalog type; "cpu" runs on the CPU, anything else on CUDA
    layer_start: int  # decoder layers [layer_start, layer_end)
    layer_end: int
    emulate_speed: float = 1.0  # < 1: this stage sleeps (1/s - 1) x its compute (emulation)
    # per layer of the stage, the (attention, MLP) weight precisions of the plan (empty: all --dtype)
    layer_precisions: tuple[tuple[str, str], ...] = ()
    weights_gib: float | None = None  # what the planner placed on the device (None: not given)
    kv_gib: float | None = None  # the KV cache the planner reserved on it
    # (seconds since the stage started serving, emulated speed) changes: the cluster's schedule
    emulate_schedule: tuple[tuple[float, float], ...] = ()
    # layers whose weights stay in host memory and stream in before they run (the plan's
    # `offload_layers`; `tessel.engine.weight_stream`), and what the plan says around them
    offload_layers: tuple[int, ...] = ()
    offload_gib: float = 0.0
    host_gib: float | None = None  # host memory the device may offload into (None: not given)
    emulate_memory_gib: float | None = None  # a CPU device's emulated memory cap (cluster `emulate`)
    emulate_host_gbps: float | None = None  # ... and its emulated host link, Gbit/s
    # tensor parallelism inside the stage (`tessel.parallel.stage`): its ranks and, on CUDA, their
    # GPUs, from the plan stage's `tp_degree` and `gpus` (plan file v5; 1 and None before it or on a CPU)
    tp_degree: int = 1
    tp_gpus: tuple[int, ...] | None = None

    @property
    def quantized_layers(self) -> dict[int, tuple[str, str]]:
        """Layer index -> (attention, MLP) precisions, for the layers with a non-float half."""
        return {
            self.layer_start + offset: halves
            for offset, halves in enumerate(self.layer_precisions)
            if any(p not in FLOAT_WEIGHTS for p in halves)
        }

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def is_cuda(self) -> bool:
        return self.gpu_type.lower() != "cpu"


@dataclass(frozen=True, slots=True)
class RunPlan:
    path: Path
    model_name: str
    num_layers: int | None  # layers of the model the plan was made for (None: not recorded)
    stages: tuple[RunStage, ...]
    micro_batches: int  # micro-batches in flight (the plan workload's m, or the replica's share)
    plan_file: PlanFile  # the plan-file model itself, for pricing
    replica: int | None = None  # which pipeline of a replica plan these stages are
    # the paths micro-batches take over the stages (`tessel.pipeline.flow`): a pipeline's one, or a
    # flow plan's routes over its placements (one process each)
    paths: tuple = ()

    def check_model(self, name: str, num_layers: int) -> None:
        """Refuse a plan made for another model: its name and the layers its stages and its model
        config say."""
        if self.num_layers is not None and self.num_layers != num_layers:
            raise TesselError(
                f"{self.path}: the plan is for {self.num_layers} layers, the model has {num_layers}; "
                "re-plan for this model (`tessel plan --model DIR`)"
            )
        self.plan_file.check_model(name, num_layers)


def load_run_plan(path: str | Path, replica: int | None = None) -> RunPlan:
    """Read a `tessel plan --json` file for the runtime (`replica`: which pipeline of a replica plan);
    TesselError says what is wrong."""
    plan = load_plan(path)
    source = Path(plan.source)
    paths = ()
    if plan.flow is not None:
        from tessel.pipeline.flow import flow_stages, refuse_replica

        if replica is not None:
            raise refuse_replica(source)
        plan_stages, paths = flow_stages(plan, source)
    else:
        plan_stages = _replica_stages(plan, source, replica)
    if plan.granularity != "layer":
        split = [s for s in plan_stages if s.unit_start % 2 or s.unit_end % 2]
        if split:
            raise TesselError(
                f"{source}: stage {split[0].index} splits a decoder layer (sublayer units "
                f"{split[0].unit_start}..{split[0].unit_end}); the runtime runs whole layers: "
                "re-plan with --granularity layer"
            )
    per_layer = plan.units_per_layer
    stages = tuple(
        RunStage(
            position,
            s.device,
            s.gpu_type,
            s.layer_start,
            s.layer_end,
            s.emulate_speed,
            _layer_precisions(s.precisions, s.unit_start, per_layer),
            s.weights_gib,
            s.kv_gib,
            tuple((seconds, speed) for seconds, speed in s.emulate_schedule or ()),
            offload_layers=_offload_layers(plan, s),
            offload_gib=s.offload_gib,
            host_gib=s.host_gib,
            emulate_memory_gib=s.emulate_memory_gib,
            emulate_host_gbps=s.emulate_host_gbps,
            tp_degree=s.tp_degree,
            tp_gpus=_tp_gpus(s, position, source),
        )
        for position, s in enumerate(plan_stages)
    )
    config = plan.model.config or {}
    num_layers = config.get("num_layers", config.get("num_hidden_layers"))
    m = plan.workload.get("m") or plan.workload.get("max_micro_batch")
    if replica is not None and plan.replicas and plan.replicas[replica].micro_batches is not None:
        m = plan.replicas[replica].micro_batches  # the replica's share of the workload's micro-batches
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        m = max(PIPELINE_MIN_MICRO_BATCHES, len(stages))
    if len(stages) == 1:
        m = 1  # nothing to overlap with: every row in one micro-batch, as one process runs them
    if paths:
        m = sum(p.micro_batches for p in paths)  # every path's slots
    else:
        from tessel.pipeline.flow import pipeline_path

        paths = pipeline_path(stages, m)
    return RunPlan(
        source,
        plan.model_name,
        int(num_layers) if isinstance(num_layers, int) and not isinstance(num_layers, bool) else None,
        stages,
        m,
        plan,
        replica,
        paths,
    )


def _replica_stages(plan: PlanFile, source: Path, replica: int | None) -> list:
    """The stages of the pipeline to run: the plan's own, or replica `replica`'s (one process group
    runs one pipeline; a load balancer splits requests by the replicas' weights)."""
    if replica is None:
        if len(plan.replicas) > 1:
            listed = ", ".join(
                f"{r.index} ({len(r.stages)} stages, weight {r.weight:.3f})" for r in plan.replicas
            )
            raise TesselError(
                f"{source}: the plan has {len(plan.replicas)} replica pipelines: {listed}; one launch runs "
                "one of them: pass --replica K (and route requests by the weights)"
            )
        return plan.stages
    count = max(len(plan.replicas), 1)
    if not 0 <= replica < count:
        raise TesselError(f"--replica {replica}: the plan has {count} pipeline(s), numbered 0..{count - 1}")
    return plan.replicas[replica].stages if plan.replicas else plan.stages


def _offload_layers(plan: PlanFile, stage) -> tuple[int, ...]:  # noqa: ANN001 (PlanStage)
    """The stage's streamed layers: the plan's `offload_layers`, or for a plan that gives only the
    offloaded GiB, the layers `tessel.plan.streamed` picks from the plan model's layer bytes."""
    if stage.offload_layers is not None:
        return tuple(stage.offload_layers)
    if stage.offload_gib <= 0:
        return ()
    from tessel.cost.layer import weight_bytes
    from tessel.plan.streamed import offload_layers

    spec, per = plan.model_spec, plan.units_per_layer
    precisions = stage.unit_precisions(plan.reference_dtype)
    layer_bytes = [0.0] * (stage.layer_end - stage.layer_start)
    for offset, precision in enumerate(precisions):
        unit = stage.unit_start + offset
        layer_bytes[unit // per - stage.layer_start] += weight_bytes(spec, plan.unit_kind(unit), precision)
    return tuple(offload_layers(stage.layer_start, layer_bytes, stage.offload_gib * 2**30))


def _layer_precisions(
    precisions: list[str] | None, unit_start: int, per_layer: int
) -> tuple[tuple[str, str], ...]:
    """Unit precisions -> (attention, MLP) per layer: a layer unit gives both halves its precision;
    at sublayer granularity the even unit is the attention half, the odd one the MLP half."""
    if not precisions:
        return ()
    if per_layer == 1:
        return tuple((p, p) for p in precisions)
    # the stage starts on a layer boundary (checked above), so the units pair up
    assert unit_start % 2 == 0 and len(precisions) % 2 == 0
    return tuple((precisions[i], precisions[i + 1]) for i in range(0, len(precisions), 2))


def priced_pipeline(plan: RunPlan, profile_paths=()) -> PipelineLatency:
    """The plan's stages priced by the cost model (with `tessel profile` fits where given, and each
    stage's emulated speed): what the CPP planner cuts prompts for and the simulator predicts with."""
    from tessel.cost.profile import load_profile
    from tessel.sim.plan_pipeline import pipeline_for

    profiles = [load_profile(p) for p in profile_paths]
    variant = None
    if plan.replica is not None and plan.plan_file.replicas:
        variant = plan.plan_file.replica_variants[plan.replica]  # the stages this launch runs
    return pipeline_for(plan.plan_file, variant, profiles=profiles).pipeline


def _tp_gpus(stage: PlanStage, position: int, source: Path) -> tuple[int, ...] | None:
    """The CUDA index of each tensor-parallel rank of a plan stage: its `gpus` names (`<node>/gpu<K>`,
    read by `gpu_index`, the rule the stage's `device` is read by). None at degree 1 and on a CPU
    stage, whose ranks are processes on the machine's cores (its `gpus` name CPU devices)."""
    if stage.tp_degree == 1 or stage.gpu_type.lower() == CPU_TYPE or not stage.gpus:
        return None
    indices = tuple(gpu_index(name) for name in stage.gpus)
    if None in indices:
        name = stage.gpus[indices.index(None)]
        raise TesselError(
            f"{source}: stage {position} ({stage.device}): gpus names {name!r}, which names no GPU index; "
            "a rank of a GPU stage runs on <node>/gpu<K>"
        )
    return indices
