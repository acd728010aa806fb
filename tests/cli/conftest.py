"""The fixtures of the CLI hardening tests; lets them import their helpers (`cli_helpers`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    """A small valid plan: Llama-2-7B over three devices (written by hand, contract version 1)."""
    stages, start = [], 0
    for index, (gpu, end) in enumerate([("A100-80G", 12), ("V100-32G", 22), ("T4", 32)]):
        link = None if index == 2 else {"bandwidth_gbps": 25.0, "latency_us": 20.0}
        stages.append(
            {
                "index": index,
                "device": f"n{index}/gpu0",
                "gpu_type": gpu,
                "unit_start": start,
                "unit_end": end,
                "layer_start": start,
                "layer_end": end,
                "link_to_next": link,
                "kv_gib": 4.0,
            }
        )
        start = end
    document = {
        "version": 1,
        "model": {"name": "llama-2-7b"},
        "cluster": {"name": "hand"},
        "workload": {"name": "w", "m": 2, "micro_batch_size": 2},
        "dtype": "fp16",
        "kv_dtype": "fp16",
        "granularity": "layer",
        "stages": stages,
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(document))
    return path
