"""A pipeline stage's compute per layer against one engine process's, in the same minutes.

    python benchmarks/stage_vs_engine.py [--rounds 3] [--requests 2] [--prompt 16] [--output 96]

Issue 30's open question: the CPU pipeline's stages measured 1.1x-1.4x the profile's price for their
layers (benchmarks/pipeline.py) while one engine process stays near it (benchmarks/fidelity.py), in
runs minutes apart on a machine whose speed drifts that much (benchmarks/machine_noise.py). This
times both in alternating rounds, so drift hits them alike:

- engine: one `LLMEngine` (1 torch thread), `requests` requests of `prompt` random token ids and
  `output` new tokens arriving at once; the model forward's process CPU seconds over the run
  (`component_profiler.time_model_calls`) per step per layer (embedding and final norm included);
- m=1: the model's uniform 2-stage split (`tessel plan ... --solver dp` on two local CPUs, its
  uniform baseline; one process per stage, 1 thread each), the same requests as one micro-batch,
  so the stages take turns;
- m=2: twice the requests in two micro-batches of `requests` rows, so the stages compute at once.

Per stage its compute CPU seconds (`StageStats.compute_cpu_s`) per micro-batch per layer: stage 0's
holds its layers and the embedding (the like of the engine's), the last stage's also the LM head
and sampling (so it reads high). Every run computes the same rows per step and per micro-batch,
prompts included. Prints a table and appends a record to benchmarks/results/stage_vs_engine.jsonl.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import _harness
from rich.console import Console
from rich.table import Table

import pipeline as bench_pipeline

FULL = {"rounds": 3, "requests": 2, "prompt": 16, "output": 96}
QUICK = {"rounds": 1, "requests": 2, "prompt": 8, "output": 6}


def engine_per_layer_s(model: Path, cfg: dict, requests: list[list[int]]) -> float:
    """Forward CPU seconds per engine step per layer."""
    import torch

    from tessel.engine.llm_engine import LLMEngine
    from tessel.engine.sampling_params import SamplingParams
    from tessel.profiling.components import time_model_calls

    torch.set_num_threads(1)
    engine = LLMEngine(
        model,
        max_num_seqs=len(requests),
        max_model_len=cfg["prompt"] + cfg["output"] + 8,
        enable_prefix_caching=False,
    )
    layers = engine.model_config.num_hidden_layers
    params = SamplingParams(temperature=0.0, max_tokens=cfg["output"], ignore_eos=True)
    spent, restore = time_model_calls(engine.runner, time.process_time, False)
    per_layer = []
    try:
        for _ in range(2):  # the first run untimed: warm caches and allocator
            for i, prompt in enumerate(requests):
                engine.add_request(f"r{len(per_layer)}-{i}", prompt, params)
            spent.update(forward=0.0, sample=0.0)
            steps = 0
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            per_layer.append(spent["forward"] / steps / layers)
    finally:
        restore()
    return per_layer[-1]


def pipeline_per_layer_s(plan: Path, model: Path, cfg: dict, requests: Path, slots: int) -> list[float]:
    """Per stage: compute CPU seconds per micro-batch per layer (`slots` micro-batches in flight)."""
    options = {"slots": slots, "output": cfg["output"], "max_model_len": cfg["prompt"] + cfg["output"] + 8}
    measured = bench_pipeline.measure(plan, model, requests, options)
    return [
        s["compute_cpu_s"] / s["batches"] / (s["layer_end"] - s["layer_start"]) for s in measured["stages"]
    ]


def uniform_plan(model: Path, work: Path) -> Path:
    cluster = bench_pipeline.write_cluster(work / "two.yaml", "two-local-cpus", [("localhost", 2, None)])
    plan = work / "plan.json"
    bench_pipeline.tessel(
        "plan", "--model", str(model), "--cluster", str(cluster), "--solver", "dp", "--dtype", "fp32",
        "--kv-dtype", "fp32", "--json", str(plan),
    )  # fmt: skip
    return bench_pipeline.variant_plan(plan, "uniform", work / "uniform.json")


def run(model: Path, cfg: dict, work: Path, console: Console) -> dict:
    from tessel.models.config import ModelConfig

    vocab = ModelConfig.from_dir(model).vocab_size
    plan = uniform_plan(model, work)
    one = bench_pipeline.prompts_file(work / "one.jsonl", cfg["requests"], cfg["prompt"], vocab, 0)
    two = bench_pipeline.prompts_file(work / "two.jsonl", 2 * cfg["requests"], cfg["prompt"], vocab, 0)
    prompts = [json.loads(line)["prompt"] for line in one.read_text().splitlines()]
    rounds = []
    for r in range(cfg["rounds"]):
        console.print(f"round {r + 1} of {cfg['rounds']} ...")
        rounds.append(
            {
                "engine_s": engine_per_layer_s(model, cfg, prompts),
                "m1_s": pipeline_per_layer_s(plan, model, cfg, one, 1),
                "m2_s": pipeline_per_layer_s(plan, model, cfg, two, 2),
            }
        )
    ratios = {
        f"{mode}_stage{k}_over_engine": statistics.median(r[f"{mode}_s"][k] / r["engine_s"] for r in rounds)
        for mode in ("m1", "m2")
        for k in range(len(rounds[0]["m1_s"]))
    }
    return {"config": cfg, "rounds": rounds, "median_ratios": ratios}


def render(result: dict, console: Console) -> None:
    table = Table(title="compute CPU ms per layer per step (engine) or micro-batch (stages), same rows")
    for col in ("round", "engine", "m=1 stage 0", "m=1 stage 1*", "m=2 stage 0", "m=2 stage 1*"):
        table.add_column(col, justify="right")
    for i, r in enumerate(result["rounds"]):
        table.add_row(str(i + 1), *(f"{1e3 * v:.3f}" for v in (r["engine_s"], *r["m1_s"], *r["m2_s"])))
    console.print(table)
    console.print("* the last stage's micro-batch also holds the LM head and sampling")
    for key, value in result["median_ratios"].items():
        console.print(f"{key}: {value:.2f}x (median over rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke test, not a measurement")
    parser.add_argument("--model", type=Path, help="HF model directory (default: SmolLM2-135M-Instruct)")
    _harness.add_record_options(parser, "stage_vs_engine")
    _harness.add_size_options(parser, FULL)
    args = parser.parse_args()
    cfg = _harness.sizes(args, QUICK if args.quick else FULL)
    args.model = _harness.example_model(args.model)
    console = Console(highlight=False)
    console.print(_harness.machine_line())
    with _harness.stopwatch() as elapsed, tempfile.TemporaryDirectory(prefix="tessel-stage-engine-") as tmp:
        result = run(args.model, cfg, Path(tmp), console)
    result.update(model=str(args.model), quick=args.quick, wall_s=elapsed.wall_s)
    render(result, console)
    _harness.append_record(args.out, "stage_vs_engine", result, args.label)


if __name__ == "__main__":
    main()
