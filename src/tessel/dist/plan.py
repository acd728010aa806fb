"""The plan as the pipeline runtime reads it: one adapter over the plan-file model.

`load_run_plan(path)` is the only place `tessel.dist` reads a plan file. It returns the stages in
pipeline order (layer range, device, emulated speed), the model the plan was made for and how many
micro-batches to keep in flight, and `check_model` refuses a plan that does not fit the checkpoint
before any process starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tessel.chunk.latency import PipelineLatency
from tessel.errors import TesselError
from tessel.sim.plan_file import load_plan

PIPELINE_MIN_MICRO_BATCHES = 2  # without a plan workload: enough to keep two stages busy


@dataclass(frozen=True, slots=True)
class RunStage:
    index: int
    device: str  # the plan's device name (e.g. localhost/gpu0)
    gpu_type: str  # catalog type; "cpu" runs on the CPU, anything else on CUDA
    layer_start: int  # decoder layers [layer_start, layer_end)
    layer_end: int
    emulate_speed: float = 1.0  # < 1: this stage sleeps (1/s - 1) x its compute (emulation)

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
    micro_batches: int  # micro-batches in flight (the plan workload's m)

    @property
    def backend(self) -> str:
        """gloo when any stage is a CPU, else NCCL."""
        return "nccl" if all(stage.is_cuda for stage in self.stages) else "gloo"

    def check_model(self, name: str, num_layers: int) -> None:
        """Refuse a plan made for another model: name (case-insensitive) and layer count."""
        if self.num_layers is not None and self.num_layers != num_layers:
            raise TesselError(
                f"{self.path}: the plan is for {self.num_layers} layers, the model has {num_layers}; "
                "re-plan for this model (`tessel plan --model DIR`)"
            )
        if _normalised(self.model_name) != _normalised(name):
            raise TesselError(
                f"{self.path}: the plan is for model {self.model_name!r}, the checkpoint is {name!r}; "
                "re-plan for this model (`tessel plan --model DIR`)"
            )
        end = self.stages[-1].layer_end
        if end != num_layers:
            raise TesselError(f"{self.path}: the stages cover layers 0..{end}, the model has {num_layers}")


def _normalised(name: str) -> str:
    return Path(name).name.lower()


def load_run_plan(path: str | Path) -> RunPlan:
    """Read a `tessel plan --json` file for the runtime; TesselError says what is wrong."""
    plan = load_plan(path)
    if plan.data.get("granularity", "layer") != "layer":
        sublayer = [s for s in plan.main.stages if s.unit_start % 2 or s.unit_end % 2]
        if sublayer:
            raise TesselError(
                f"{plan.path}: stage {sublayer[0].index} splits a decoder layer (sublayer units "
                f"{sublayer[0].unit_start}..{sublayer[0].unit_end}); the runtime runs whole layers: "
                "re-plan with --granularity layer"
            )
    raw_stages = plan.data.get("stages") or []
    stages = []
    for position, stage in enumerate(plan.main.stages):
        if stage.layer_end <= stage.layer_start:
            raise TesselError(
                f"{plan.path}: stage {position} ({stage.device}) holds no layers "
                f"({stage.layer_start}..{stage.layer_end}); every stage needs at least one"
            )
        speed = _speed(plan.path, position, raw_stages[position])
        stages.append(
            RunStage(position, stage.device, stage.gpu_type, stage.layer_start, stage.layer_end, speed)
        )
    if stages[0].layer_start != 0:
        raise TesselError(f"{plan.path}: the first stage starts at layer {stages[0].layer_start}, not 0")
    for before, after in zip(stages, stages[1:], strict=False):
        if after.layer_start != before.layer_end:
            raise TesselError(
                f"{plan.path}: stage {before.index} ends at layer {before.layer_end} but stage "
                f"{after.index} starts at {after.layer_start}"
            )
    model = plan.data.get("model") or {}
    config = model.get("config") if isinstance(model.get("config"), dict) else {}
    num_layers = config.get("num_layers", config.get("num_hidden_layers"))
    workload = plan.data.get("workload") if isinstance(plan.data.get("workload"), dict) else {}
    m = workload.get("m") or workload.get("max_micro_batch") or max(PIPELINE_MIN_MICRO_BATCHES, len(stages))
    return RunPlan(
        plan.path,
        plan.model_name,
        None if num_layers is None else int(num_layers),
        tuple(stages),
        max(1, int(m)),
    )


def _speed(path: Path, position: int, raw: object) -> float:
    speed = raw.get("emulate_speed", 1.0) if isinstance(raw, dict) else 1.0
    try:
        speed = float(speed if speed is not None else 1.0)
    except (TypeError, ValueError):
        raise TesselError(f"{path}: stages[{position}].emulate_speed must be a number, got {speed!r}") from None
    if not (math.isfinite(speed) and 0 < speed <= 1):
        raise TesselError(f"{path}: stages[{position}].emulate_speed must be in (0, 1], got {speed}")
    return speed


def priced_pipeline(path: str | Path, profile_paths=()) -> PipelineLatency:
    """The plan's stages priced by the cost model (with `tessel profile` fits where given): what the
    CPP planner cuts prompts for, and what the simulator predicts with."""
    from tessel.cost.profile import load_profile
    from tessel.sim.plan_pipeline import pipeline_for

    profiles = [load_profile(p) for p in profile_paths]
    return pipeline_for(load_plan(path), profiles=profiles).pipeline
