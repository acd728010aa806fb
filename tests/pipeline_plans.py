"""Hand-written plan files for pipeline-runtime tests and benchmarks."""

from __future__ import annotations

import json
from pathlib import Path


def write_plan(
    path: Path,
    model_dir: Path,
    splits: list[tuple[int, int]],
    *,
    micro_batches: int = 2,
    speeds: list[float] | None = None,
    devices: list[str] | None = None,
    **overrides,
) -> Path:
    """A version-1 plan file for `model_dir` with stages holding layers [a, b) on local CPUs (or on
    the CPU `devices` name, e.g. `h1/cpu0`: a stage on machine h1)."""
    config = json.loads((model_dir / "config.json").read_text())
    stages = []
    for i, (a, b) in enumerate(splits):
        last = i == len(splits) - 1
        stage = {
            "index": i,
            "device": devices[i] if devices is not None else f"localhost/cpu{i}",
            "gpu_type": "cpu",
            "layer_start": a,
            "layer_end": b,
            "unit_start": a,
            "unit_end": b,
            "link_to_next": None if last else {"bandwidth_gbps": 80.0, "latency_us": 50.0},
        }
        if speeds is not None:
            stage["emulate_speed"] = speeds[i]
        stages.append(stage)
    plan = {
        "version": 1,
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
