"""A planner-made flow plan, end to end on this CPU machine: `tessel plan --replicas auto` chooses a
flow plan whose paths share a placement, `tessel launch` runs it as one process per placement and
every greedy output equals HF transformers' greedy continuation, and `tessel simulate` runs it.

The cluster (three CPU devices on one host, written below) is one where flow is the right answer in
the planner's cost model, not a forced one:
- `fast` runs at the CPU's speed, `slow` and `mid` are emulated at 0.05 and 0.1 of it;
- each device's emulated memory holds its planner workspace, the embedding or the LM head and three
  of the model's six layers, plus KV room of 0.8 of a layer, never four layers. So no device holds
  the whole model, and the only disjoint plans are one pipeline through two or all three devices.
In one pipeline the slowest stage sets every request's pace: `slow` and `mid` must hold at least
half of the layers between them, in whole layers, each stage paying its own hop, and `fast` waits on
them. In the flow plan `slow` and `mid` each hold layers 0-2 and serve different requests side by
side, so their rates add (each path gets the share of requests its first device's speed allows:
unequal weights), and both feed `fast`, which holds layers 3-5 for every request and is kept busy.
The planner prices all three kinds (one pipeline, disjoint replicas, flow) and returns the best.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tiny_models
from hf_oracle import hf_greedy
from tessel.cli import app

LAYERS = 6
HELD_LAYERS = 3  # each device holds half of the model...
KV_ROOM_LAYERS = 0.8  # ... and KV for this fraction of a layer's weights: a fourth layer never fits
SPEEDS = {"fast": 1.0, "slow": 0.05, "mid": 0.1}
MAX_PROMPT, MAX_OUTPUT = 32, 8  # the workload's longest prompt and answer, tokens
WORKLOAD = f"""\
name: offline-tiny
description: an offline batch of short requests, one per micro-batch
prompt_tokens: {{mean: 16, max: {MAX_PROMPT}}}
output_tokens: {{mean: {MAX_OUTPUT}, max: {MAX_OUTPUT}}}
batch_size: 64
max_micro_batch: 64
"""
PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a small model",
    "Paged attention stores keys and values in blocks.",
    "Digits 12345 and punctuation!",
    "To be or not to be, that is the question.",
    "The cat sat on the mat.",
    "What is the capital of France?",
    "A journey of a thousand miles",
    "def main(): print",
]
MAX_TOKENS = 6


def _cluster_yaml(memory_gib: float | None) -> str:
    lines = ["name: flow-cpu", "nodes:"]
    for name, speed in SPEEDS.items():
        emulate = {} if speed == 1.0 else {"speed": speed}
        if memory_gib is not None:
            emulate["memory_gib"] = memory_gib
        lines += [
            f"  - name: {name}",
            "    gpus: {type: cpu, count: 1}",
            "    intra_link: {bandwidth_gbps: 80, latency_us: 50}",
        ]
        if emulate:
            lines.append("    emulate: {" + ", ".join(f"{k}: {v!r}" for k, v in emulate.items()) + "}")
    lines.append("network: {bandwidth_gbps: 80, latency_us: 50}")
    return "\n".join(lines) + "\n"


def _half_model_memory_gib(model: Path, workload: Path, tmp_path: Path) -> float:
    """Memory for the planner's workspace, the larger of embedding and LM head, HELD_LAYERS layers and
    KV_ROOM_LAYERS of a layer, read from the planner's own instance on the cluster without caps."""
    from tessel.plan.api import PlanSettings, prepare_plan

    free = tmp_path / "uncapped.yaml"
    free.write_text(_cluster_yaml(None))
    instance = prepare_plan(model, free, workload, PlanSettings(dtype="fp32", kv_dtype="fp32")).instance
    layer = float(instance.weight_bytes.max())
    need = (
        float(instance.workspace_bytes.max())
        + max(instance.first_bytes, instance.last_bytes)
        + (HELD_LAYERS + KV_ROOM_LAYERS) * layer
    )
    return need / 2**30


@pytest.fixture(scope="module")
def flow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six layers, one KV head, a wide MLP: a layer's weights are large beside a request's KV."""
    root = tmp_path_factory.mktemp("flow-e2e")
    return tiny_models.make_tiny_checkpoint(
        root / "model", num_hidden_layers=LAYERS, num_kv_heads=1, intermediate_size=512, seed=4
    )


def _invoke(args: list) -> str:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, (args[0], repr(result.exception), result.output[-3000:])
    return result.output


def test_planned_flow_plan_launches_and_matches_hf(flow_model, tmp_path) -> None:
    """plan -> a flow plan with a shared placement, predicted above one pipeline and disjoint
    replicas -> launch: each greedy output equals HF's, requests split by the path weights within
    one -> simulate: every request served over the paths."""
    from tessel.plan.files.plan_file import load_plan

    workload = tmp_path / "offline-tiny.yaml"
    workload.write_text(WORKLOAD)
    cluster = tmp_path / "flow-cpu.yaml"
    cluster.write_text(_cluster_yaml(_half_model_memory_gib(flow_model, workload, tmp_path)))
    plan_path = tmp_path / "plan.json"
    out = _invoke([
        "plan", "--model", flow_model, "--cluster", cluster, "--workload", workload, "--replicas", "auto",
        "--dtype", "fp32", "--kv-dtype", "fp32", "--time-limit", 7, "--json", plan_path,
    ])  # fmt: skip
    line = r"chosen: (\w+), ([\d.]+) tok/s; one pipeline ([\d.]+), disjoint replicas ([\d.]+)"
    chosen = re.search(line, " ".join(out.split()))
    assert chosen is not None and chosen[1] == "flow", out[-3000:]
    flow_tok, single_tok, replicas_tok = (float(chosen[i]) for i in (2, 3, 4))
    assert flow_tok > max(single_tok, replicas_tok), chosen[0]

    plan = load_plan(plan_path)
    assert plan.version == 5 and plan.flow is not None
    paths = [[s.device for s in r.stages] for r in plan.replicas]
    visits = [d for devices in paths for d in devices]
    shared = {d for d in visits if visits.count(d) > 1}
    assert len(paths) >= 2 and shared == {"fast/gpu0"}, paths  # the fast device serves every path
    assert all(len(set(devices)) == len(devices) for devices in paths)
    weights = [r.weight for r in plan.replicas]
    assert sum(weights) == pytest.approx(1.0)
    assert plan.predicted.throughput_tok_s == pytest.approx(flow_tok, abs=0.05)  # the whole plan's

    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt": p, "max_tokens": MAX_TOKENS}) + "\n" for p in PROMPTS))
    outputs = tmp_path / "outputs.json"
    _invoke([
        "launch", "--plan", plan_path, "--model", flow_model, "--prompts-file", requests, "--ignore-eos",
        "--max-model-len", MAX_PROMPT + MAX_OUTPUT, "--json", outputs,
    ])  # fmt: skip
    run = json.loads(outputs.read_text())
    from tessel.engine.llm_engine import load_tokenizer

    tokenizer = load_tokenizer(flow_model)
    assert len(run["requests"]) == len(PROMPTS)
    for prompt, result in zip(PROMPTS, run["requests"], strict=True):
        ids = list(tokenizer(prompt)["input_ids"])
        assert len(ids) <= MAX_PROMPT
        assert result["token_ids"] == hf_greedy(flow_model, ids, MAX_TOKENS, ignore_eos=True), prompt
    placements = {p.device for p in plan.flow.placements}
    assert len(run["stages"]) == len(placements) and all(s["state"] == "done" for s in run["stages"])
    split = run["stages"][0]["path_requests"]
    assert sum(split.values()) == len(PROMPTS)
    assert all(abs(split[str(i)] - w * len(PROMPTS)) < 1 for i, w in enumerate(weights)), (split, weights)
    assert all(s["batches"] > 0 for s in run["stages"])  # every placement ran micro-batches

    sim_json = tmp_path / "sim.json"
    _invoke(["simulate", "--plan", plan_path, "--workload", workload, "--requests", 64, "--json", sim_json])
    sim = json.loads(sim_json.read_text())
    (result,) = sim["results"].values()
    assert result["metrics"]["requests"] == 64
    assert result["metrics"]["output_tokens"] == 64 * MAX_OUTPUT
    assert len(result["stages"]) == len(visits)  # each path's stages, the shared placement in each


def test_a_time_limit_too_short_for_the_flow_search_says_so(flow_model, tmp_path) -> None:
    """On this cluster, where flow wins, `--replicas auto` with a time limit below the flow search's
    share compares no flow plan: the output says so and why, instead of looking like a full search."""
    workload = tmp_path / "offline-tiny.yaml"
    workload.write_text(WORKLOAD)
    cluster = tmp_path / "flow-cpu.yaml"
    cluster.write_text(_cluster_yaml(_half_model_memory_gib(flow_model, workload, tmp_path)))
    out = _invoke([
        "plan", "--model", flow_model, "--cluster", cluster, "--workload", workload, "--replicas", "auto",
        "--dtype", "fp32", "--kv-dtype", "fp32", "--time-limit", 1,
    ])  # fmt: skip
    text = " ".join(out.split())
    assert "chosen: flow" not in text
    left = re.search(r"flow plans not searched: ([\d.]+) s of the time limit .* needs ([\d.]+) s", text)
    assert left is not None and float(left[1]) < float(left[2]), text
