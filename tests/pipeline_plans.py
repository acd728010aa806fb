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
    **overrides,
) -> Path:
    """A version-1 plan file for `model_dir` with stages holding layers [a, b) on local CPUs."""
    config = json.loads((model_dir / "config.json").read_text())
    stages = []
    for i, (a, b) in enumerate(splits):
        last = i == len(splits) - 1
        stage = {
            "index": i,
            "device": f"localhost/cpu{i}",
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
