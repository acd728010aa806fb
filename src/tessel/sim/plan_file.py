"""The parts of a `tessel plan --json` file (version 1) the simulator reads.

A plan file holds the chosen plan's stages and, under `baselines`, the stages of each baseline
split (uniform, memory- and compute-proportional, Petals-style greedy) when it was feasible. Each
becomes a `PlanVariant`: a name and its stages in pipeline order. A malformed file raises
`TesselError` naming the file and the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tessel.errors import TesselError
from tessel.files import read_json_file

PLAN_VERSION = 1
MAIN_VARIANT = "plan"


@dataclass(frozen=True, slots=True)
class PlanStage:
    index: int
    device: str
    gpu_type: str
    layer_start: int  # half-open [layer_start, layer_end)
    layer_end: int
    unit_start: int
    unit_end: int
    link_bandwidth_gbps: float | None  # link to the next stage; None on the last
    link_latency_us: float | None
    offload_gib: float = 0.0  # weights/KV held in host memory, streamed in every pass
    kv_gib: float = 0.0  # KV cache the planner reserved on this stage (0 = not given)

    @property
    def label(self) -> str:
        return f"{self.device} ({self.gpu_type}) L{self.layer_start}-{self.layer_end - 1}"


@dataclass(frozen=True, slots=True)
class PlanVariant:
    name: str
    stages: tuple[PlanStage, ...]
    predicted: dict[str, float] = field(default_factory=dict)  # ttft_s, tpot_s, throughput_tok_s


@dataclass(frozen=True, slots=True)
class PlanFile:
    path: Path
    data: dict  # the whole JSON document, for builders that need the model, cluster, dtypes
    main: PlanVariant
    baselines: tuple[PlanVariant, ...]  # feasible baselines only
    infeasible: dict[str, str]  # baseline name -> reason it has no plan

    @property
    def model_name(self) -> str:
        return str(self.data.get("model", {}).get("name", "?"))

    @property
    def cluster_name(self) -> str:
        return str(self.data.get("cluster", {}).get("name", "?"))


def load_plan(path: str | Path) -> PlanFile:
    path = Path(path)
    if not path.exists():
        raise TesselError(f"plan file {path} does not exist (make one with `tessel plan --json`)")
    data = read_json_file(path, "plan file")
    if not isinstance(data, dict):
        raise TesselError(f"{path}: a plan file holds a JSON object")
    if data.get("version", PLAN_VERSION) != PLAN_VERSION:
        raise TesselError(f"{path}: plan version {data.get('version')!r}, expected {PLAN_VERSION}")
    main = PlanVariant(MAIN_VARIANT, _stages(path, "stages", data.get("stages")), _predicted(data))
    baselines, infeasible = [], {}
    raw_baselines = data.get("baselines") or {}
    if not isinstance(raw_baselines, dict):
        raise TesselError(f"{path}: 'baselines' must be an object keyed by baseline name")
    for name, entry in raw_baselines.items():
        if not isinstance(entry, dict):
            raise TesselError(f"{path}: baselines.{name} must be an object")
        if not entry.get("feasible") or not entry.get("stages"):
            infeasible[name] = str(entry.get("reason") or "no feasible split")
            continue
        stages = _stages(path, f"baselines.{name}.stages", entry["stages"])
        baselines.append(PlanVariant(name, stages, _predicted(entry)))
    return PlanFile(path, data, main, tuple(baselines), infeasible)


def _predicted(entry: dict) -> dict[str, float]:
    predicted = entry.get("predicted") or {}
    return {
        k: float(v) for k, v in predicted.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


def _stages(path: Path, where: str, raw: object) -> tuple[PlanStage, ...]:
    if not isinstance(raw, list) or not raw:
        raise TesselError(f"{path}: '{where}' must be a non-empty list of stages")
    stages = []
    for position, entry in enumerate(raw):
        key = f"{where}[{position}]"
        if not isinstance(entry, dict):
            raise TesselError(f"{path}: {key} must be an object")
        link = entry.get("link_to_next")
        if link is not None and not isinstance(link, dict):
            raise TesselError(f"{path}: {key}.link_to_next must be an object or null")
        try:
            layer_start, layer_end = int(entry["layer_start"]), int(entry["layer_end"])
            stage = PlanStage(
                index=int(entry.get("index", position)),
                device=str(entry["device"]),
                gpu_type=str(entry["gpu_type"]),
                layer_start=layer_start,
                layer_end=layer_end,
                unit_start=int(entry.get("unit_start", layer_start)),
                unit_end=int(entry.get("unit_end", layer_end)),
                link_bandwidth_gbps=None if link is None else float(link["bandwidth_gbps"]),
                link_latency_us=None if link is None else float(link.get("latency_us", 0.0)),
                offload_gib=float(entry.get("offload_gib") or 0.0),
                kv_gib=float(entry.get("kv_gib") or 0.0),
            )
        except KeyError as error:
            raise TesselError(f"{path}: {key} lacks {error.args[0]!r}") from None
        except (TypeError, ValueError) as error:
            raise TesselError(f"{path}: {key} has a bad value ({error})") from None
        if stage.unit_end <= stage.unit_start:
            raise TesselError(f"{path}: {key} holds no units ({stage.unit_start}..{stage.unit_end})")
        stages.append(stage)
    for before, after in zip(stages, stages[1:], strict=False):
        if after.unit_start != before.unit_end:
            raise TesselError(
                f"{path}: '{where}' is not contiguous: a stage ends at unit {before.unit_end}, "
                f"the next starts at {after.unit_start}"
            )
    return tuple(stages)
