"""A small hand-written plan file for the simulator tests (independent of `tessel plan`)."""

from __future__ import annotations

import json
from pathlib import Path

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "num_hidden_layers": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}


def plan_stage(index: int, gpu: str, start: int, end: int, last: bool) -> dict:
    return {
        "index": index,
        "device": f"node/gpu{index}",
        "gpu_type": gpu,
        "node": "node",
        "layer_start": start,
        "layer_end": end,
        "unit_start": start,
        "unit_end": end,
        "link_to_next": None if last else {"bandwidth_gbps": 100.0, "latency_us": 5.0},
        "kv_gib": 0.5 * (end - start),
    }


def write_plan(tmp_path: Path) -> Path:
    split = [("A100-80G", 0, 4), ("T4", 4, 6), ("T4", 6, 8)]
    uniform = [("A100-80G", 0, 3), ("T4", 3, 6), ("T4", 6, 8)]
    plan = {
        "version": 1,
        "model": {"name": "tiny-llama", "config": TINY_LLAMA},
        "cluster": {"name": "test", "source": "test"},
        "dtype": "fp16",
        "kv_dtype": "fp16",
        "granularity": "layer",
        "stages": [plan_stage(i, g, a, b, i == 2) for i, (g, a, b) in enumerate(split)],
        "predicted": {"ttft_s": 0.01, "tpot_s": 0.002, "throughput_tok_s": 1000.0},
        "baselines": {
            "uniform": {
                "feasible": True,
                "stages": [plan_stage(i, g, a, b, i == 2) for i, (g, a, b) in enumerate(uniform)],
                "predicted": {"ttft_s": 0.02},
            },
            "petals_greedy": {"feasible": False, "reason": "does not fit", "stages": None},
        },
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path
