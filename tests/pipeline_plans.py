"""Hand-written plan files for pipeline-runtime tests and benchmarks."""

from __future__ import annotations

import json
from pathlib import Path


def _stage(index: int, device: str, a: int, b: int, last: bool) -> dict:
    return {
        "index": index,
        "device": device,
        "gpu_type": "cpu",
        "layer_start": a,
        "layer_end": b,
        "unit_start": a,
        "unit_end": b,
        "link_to_next": None if last else {"bandwidth_gbps": 80.0, "latency_us": 50.0},
    }


def _tensor_parallel(stages: list[dict], degrees: list[int]) -> None:
    """Stage k over `degrees[k]` CPUs of its machine: its device, then CPUs numbered after the stages'."""
    spare = len(stages)  # the next CPU number no stage names
    for stage, degree in zip(stages, degrees, strict=True):
        node = stage["device"].split("/", 1)[0]
        stage["tp_degree"] = degree
        stage["gpus"] = [stage["device"], *(f"{node}/cpu{spare + r}" for r in range(degree - 1))]
        stage["tp_link"] = {"bandwidth_gbps": 80.0, "latency_us": 50.0} if degree > 1 else None
        spare += degree - 1


def write_plan(
    path: Path,
    model_dir: Path,
    splits: list[tuple[int, int]],
    *,
    micro_batches: int = 2,
    speeds: list[float] | None = None,
    devices: list[str] | None = None,
    degrees: list[int] | None = None,
    **overrides,
) -> Path:
    """A version-1 plan file for `model_dir` with stages holding layers [a, b) on local CPUs (or on
    the CPU `devices` name, e.g. `h1/cpu0`: a stage on machine h1). `degrees`: a version-5 plan whose
    stage k is tensor-parallel over `degrees[k]` CPUs of its machine (`gpus`: its device, then CPUs
    numbered after the stages') with a `tp_link`."""
    config = json.loads((model_dir / "config.json").read_text())
    stages = []
    for i, (a, b) in enumerate(splits):
        device = devices[i] if devices is not None else f"localhost/cpu{i}"
        stage = _stage(i, device, a, b, last=i == len(splits) - 1)
        if speeds is not None:
            stage["emulate_speed"] = speeds[i]
        stages.append(stage)
    if degrees is not None:
        _tensor_parallel(stages, degrees)
    plan = {
        "version": 1 if degrees is None else 5,
        "model": {"name": model_dir.name, "config": config},
        "workload": {"m": micro_batches},
        "dtype": "fp32",
        "kv_dtype": "fp32",
        "granularity": "layer",
        "stages": stages,
        **overrides,
    }
    path.write_text(json.dumps(plan))
    return path


REPLICA_WEIGHTS = (0.625, 0.375)  # write_replica_plan's: replica 0 (2 stages), replica 1 (1 stage)


def write_replica_plan(path: Path, model_dir: Path, micro_batches: int = 2) -> Path:
    """A version-2 plan of two pipelines: replica 0 on cpu0 + cpu1 (the layers split in halves,
    `micro_batches` in flight), replica 1 on cpu2 alone (one micro-batch); `REPLICA_WEIGHTS`."""
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    write_plan(path, model_dir, [(0, layers // 2), (layers // 2, layers)], micro_batches=micro_batches)
    plan = json.loads(path.read_text())
    plan["version"] = 2
    first = plan["stages"]
    solo = {**first[1], "index": 0, "device": "localhost/cpu2", "layer_start": 0, "unit_start": 0}
    plan["replicas"] = [
        {"index": 0, "weight": REPLICA_WEIGHTS[0], "stages": first},
        {"index": 1, "weight": REPLICA_WEIGHTS[1], "stages": [solo], "micro_batches": 1},
    ]
    path.write_text(json.dumps(plan))
    return path


def write_flow_plan(path: Path, model_dir: Path, placements: dict, paths: list, **edits) -> Path:
    """A version-4 flow plan on CPUs: `placements` device (`localhost/cpu1`, or `h1/cpu0`: on machine
    h1) -> (first layer, end layer); `paths` (devices in order, weight, micro-batches)."""
    config = json.loads((model_dir / "config.json").read_text())
    replicas = []
    for index, (devices, weight, slots) in enumerate(paths):
        stages = [_stage(i, d, *placements[d], last=i == len(devices) - 1) for i, d in enumerate(devices)]
        replicas.append({"index": index, "weight": weight, "stages": stages, "micro_batches": slots})
    edges: dict[tuple[str, str], float] = {}
    for devices, weight, _ in paths:
        hops = ["source", *devices, "sink"]
        for a, b in zip(hops, hops[1:], strict=False):
            edges[(a, b)] = edges.get((a, b), 0.0) + weight
    flow = {
        "placements": [
            {
                "device": d,
                "gpu_type": "cpu",
                "node": d.split("/", 1)[0],
                "layer_start": a,
                "layer_end": b,
                "unit_start": a,
                "unit_end": b,
            }
            for d, (a, b) in placements.items()
        ],  # fmt: skip
        "edges": [{"source": a, "target": b, "weight": w} for (a, b), w in edges.items()],
    }
    plan = {
        "version": 4,
        "model": {"name": model_dir.name, "config": config},
        "workload": {"m": sum(slots for _, _, slots in paths)},
        "dtype": "fp32",
        "kv_dtype": "fp32",
        "granularity": "layer",
        "stages": replicas[0]["stages"],
        "replicas": replicas,
        "flow": flow,
        **edits,
    }
    path.write_text(json.dumps(plan))
    return path


def write_gpu_plan(path: Path, gpu_types: list[str], model: str, layers: int) -> Path:
    """A version-1 plan of `model` (a preset name) on GPUs `n/gpu<k>` of `gpu_types`, the layers split
    evenly (the last stage takes the rest)."""
    per = layers // len(gpu_types)
    stages = []
    for i, gpu in enumerate(gpu_types):
        a, b = i * per, layers if i == len(gpu_types) - 1 else (i + 1) * per
        link = None if i == len(gpu_types) - 1 else {"bandwidth_gbps": 100.0, "latency_us": 5.0}
        stages.append(
            {"index": i, "device": f"n/gpu{i}", "gpu_type": gpu, "layer_start": a, "layer_end": b,
             "unit_start": a, "unit_end": b, "link_to_next": link}
        )  # fmt: skip
    plan = {"version": 1, "model": {"name": model}, "dtype": "fp16", "stages": stages}
    path.write_text(json.dumps(plan))
    return path
