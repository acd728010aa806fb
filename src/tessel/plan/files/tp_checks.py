"""The checks of a plan's tensor-parallel stages, in one place: the planner's plan file runs them on
load, `PlanFile.check_cluster` with the cluster, and a runtime calls `check_tp_stages(plan, model,
cluster)` before it starts any process.

Refused, naming the stage and the numbers:
- a degree other than 1, 2, 4, 8, or one that does not divide the model's heads or KV heads;
- `gpus` that do not list one GPU per rank, or whose rank 0 is not the stage's `device`;
- a GPU named twice in one pipeline (two ranks, or a rank and another stage);
- with a cluster: a GPU it lacks, GPUs of one stage on different machines or of different types,
  a degree above the GPUs of that type on the machine.
Without a cluster the machine of a GPU is read from its name (`<node>/gpu<i>`, as plans name them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessel.cost.tensor_parallel import TP_DEGREES, degree_problem
from tessel.errors import TesselError

if TYPE_CHECKING:
    from tessel.catalog.models import ModelSpec
    from tessel.plan.files.cluster import Cluster
    from tessel.plan.files.plan_file import PlanFile
    from tessel.plan.files.plan_parts import PlanStage


def check_tp_stages(plan: PlanFile, model: ModelSpec | None = None, cluster: Cluster | None = None) -> None:
    """Raise `TesselError` listing every problem of the plan's tensor-parallel stages (module
    docstring); `model` defaults to the plan's, `cluster` to the one it names when that can be found
    (a bundled name or a cluster file; without one the cluster checks are skipped)."""
    problems = tp_problems(plan, model)
    if cluster is None:
        cluster = plan.named_cluster()
    if cluster is not None:
        problems += cluster_problems(plan, cluster)
    if problems:
        raise TesselError(f"{plan.source}: " + "; ".join(problems))


def _pipelines(plan: PlanFile) -> list[tuple[str, tuple[PlanStage, ...]]]:
    """(where, stages) of every pipeline of the plan: its own, each baseline's, each replica's."""
    found = [("stages", tuple(plan.stages))]
    found += [(f"baselines.{n}.stages", tuple(b.stages)) for n, b in plan.baselines.items() if b.stages]
    found += [(f"replicas[{r.index}].stages", tuple(r.stages)) for r in plan.replicas]
    return found


def tp_problems(plan: PlanFile, model: ModelSpec | None = None) -> list[str]:
    """What is wrong with the plan's tensor-parallel stages on their own and against the model."""
    problems: list[str] = []
    for where, stages in _pipelines(plan):
        seen: dict[str, str] = {}
        for position, stage in enumerate(stages):
            key = f"{where}[{position}] ({stage.device})"
            problems += _stage_problems(key, stage)
            for rank, gpu in enumerate(stage.rank_gpus):
                if gpu in seen:
                    problems.append(f"GPU {gpu!r} is named twice: {seen[gpu]} and {key} rank {rank}")
                seen.setdefault(gpu, f"{key} rank {rank}")
    if any(stage.tp_degree > 1 for _where, stages in _pipelines(plan) for stage in stages):
        problems += _model_problems(plan, model)
    return problems


def _stage_problems(key: str, stage: PlanStage) -> list[str]:
    d = stage.tp_degree
    if d not in TP_DEGREES:
        return [f"{key}: tp_degree {d} is not one of {', '.join(map(str, TP_DEGREES))}"]
    gpus = stage.gpus
    if gpus is None:
        return [] if d == 1 else [f"{key}: tp_degree {d} needs `gpus`, one GPU per rank ({d})"]
    problems = []
    if len(gpus) != d:
        problems.append(f"{key}: tp_degree {d} but {len(gpus)} gpus listed ({', '.join(gpus)})")
    if gpus and gpus[0] != stage.device:
        problems.append(f"{key}: gpus[0] is {gpus[0]!r}, not the stage's device (rank 0 runs on it)")
    nodes = sorted({gpu.split("/", 1)[0] for gpu in gpus if "/" in gpu})
    if len(nodes) > 1:
        problems.append(f"{key}: its {len(gpus)} GPUs are on different machines ({', '.join(nodes)})")
    return problems


def _model_problems(plan: PlanFile, model: ModelSpec | None) -> list[str]:
    if model is None:
        try:
            model = plan.model_spec
        except TesselError as error:
            return [f"tensor-parallel stages need the model's heads: {error}"]
    problems = []
    for where, stages in _pipelines(plan):
        for position, stage in enumerate(stages):
            problem = degree_problem(model, stage.tp_degree) if stage.tp_degree in TP_DEGREES else None
            if problem is not None:
                problems.append(f"{where}[{position}] ({stage.device}): {problem}")
    return problems


def cluster_problems(plan: PlanFile, cluster: Cluster) -> list[str]:
    """What is wrong with the plan's tensor-parallel stages on `cluster`."""
    names = {device.name: device for device in cluster.devices}
    problems = []
    for where, stages in _pipelines(plan):
        for position, stage in enumerate(stages):
            if stage.tp_degree == 1 and not stage.gpus:
                continue
            key = f"{where}[{position}] ({stage.device})"
            missing = [gpu for gpu in stage.rank_gpus if gpu not in names]
            if missing:
                problems.append(f"{key}: {', '.join(missing)} not in cluster {cluster.name}")
                continue
            devices = [names[gpu] for gpu in stage.rank_gpus]
            nodes = sorted({d.node for d in devices})
            if len(nodes) > 1:
                problems.append(
                    f"{key}: its {len(devices)} GPUs are on different machines ({', '.join(nodes)})"
                )
            types = sorted({d.gpu_type for d in devices})
            if len(types) > 1:
                problems.append(f"{key}: its GPUs are of different types ({', '.join(types)})")
            node = devices[0].node
            count = sum(1 for d in cluster.devices if d.node == node and d.gpu_type == devices[0].gpu_type)
            if stage.tp_degree > count:
                problems.append(
                    f"{key}: tp_degree {stage.tp_degree} is above the {count} {devices[0].gpu_type} GPUs of "
                    f"machine {node}"
                )
    return problems
