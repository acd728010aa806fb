"""Streamed weights (issue 31, item 1): a stage with half its layers in host memory against the same
stage holding all of them, and the measured decode step against what the planner predicts for it;
print a table, append a record to benchmarks/results/offload_weights.jsonl.

    python benchmarks/offload_weights.py [--quick] [--host-gbps 16 128] [--model DIR] [--profile FILE]
    python benchmarks/offload_weights.py --device cuda     # the GPU target (gpu_checks.sh step)

CPU (the default; emulation on one CPU, never a GPU figure): SmolLM2-135M-Instruct (fp32, one
stage, `--threads` threads). This CPU is profiled first (`tessel profile`, unless `--profile`), then
for each `--host-gbps` b the planner plans the model on a one-CPU cluster file emulating a device of
`memory_gib` g with a host link of b Gbit/s (`emulate: {memory_gib, host_gbps}`, `--overlap`: a
stage's time is the larger of its compute and its transfer, as the runtime overlaps them); g is
searched so the plan streams half the layers. The resident row plans the same cluster without the
memory cap. Each plan runs in process (an engine on the plan's `ProcessExecutor`, as stage 0 of
`tessel launch`): a closed batch of `--requests` prompts of `--prompt` random tokens, `--new-tokens`
each, greedy. Every engine step is timed, wall and process CPU time (every thread's: "cpu ms", the
figure a loaded shared machine distorts least; the emulated link's sleeps are not in it); the first
step is the prefill, the rest decode steps (their median is "decode ms").
Per decode step: transfer seconds exposed (compute waiting for a copy) and hidden (the rest of the
copy time), from the stage's stats. "pred ms" is the plan's `decode_ms` for the stage; "err" and
"err cpu" = (predicted - measured) / measured against the wall and the CPU time. The planner prices
the whole streamed layers each step copies, and on a CPU the copies on its compute's cores
(`tessel.plan.instance`); "pred bytes" is the older rule for comparison: the resident plan's step
against only the offloaded bytes over the link, overlapped (max of the two). Tokens are held to the
resident run's.

CUDA (`--device cuda`, Llama-3.2-1B's shapes with random weights, float16): the same, on the GPU (a
cluster file of this GPU type with `memory_gib` searched as above, the real PCIe link), plus HF
accelerate's offload (`device_map="auto"` with the same `max_memory`) as the baseline: the issue's
target is tessel >= 2x accelerate's tok/s and the decode step within 15% of the prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness
from rich.console import Console
from rich.table import Table

FULL = {"requests": 4, "prompt": 64, "new_tokens": 24, "profile_budget_s": 40}
QUICK = {"requests": 2, "prompt": 16, "new_tokens": 6, "profile_budget_s": 10}
CUDA = {"requests": 8, "prompt": 128, "new_tokens": 64, "profile_budget_s": 60}
HOST_MEMORY_GIB = 64  # the emulated node's host memory: room for every streamed layer


def tessel(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "tessel.cli", *args], check=True, stdout=subprocess.DEVNULL)


def write_workload(path: Path, cfg: dict) -> Path:
    path.write_text(
        "name: offload-bench\n"
        f"prompt_tokens: {{mean: {cfg['prompt']}, max: {cfg['prompt']}}}\n"
        f"output_tokens: {{mean: {cfg['new_tokens']}, max: {cfg['new_tokens']}}}\n"
        f"batch_size: {cfg['requests']}\nmax_micro_batch: 1\n"
    )
    return path


def write_cluster(path: Path, gpu_type: str, memory_gib: float | None, host_gbps: float | None) -> Path:
    """One device; on a CPU the cap and link are emulated, on a GPU the cap is its `memory_gib`."""
    lines = ["name: offload-bench", "nodes:", "  - name: n", f"    host_memory_gib: {HOST_MEMORY_GIB}"]
    if gpu_type == "cpu":
        lines.append("    gpus: {type: cpu}")
        emulate = {"memory_gib": memory_gib, "host_gbps": host_gbps}
        fields = ", ".join(f"{k}: {v}" for k, v in emulate.items() if v is not None)
        if fields:
            lines.append(f"    emulate: {{{fields}}}")
    else:
        reserved_gib = _reserved_gib(gpu_type)
        memory = "" if memory_gib is None else f", memory_gib: {memory_gib + reserved_gib}"
        lines.append(f"    gpus: {{type: {gpu_type}{memory}}}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _reserved_gib(gpu_type: str) -> float:
    from tessel.catalog import get_gpu

    return get_gpu(gpu_type).reserved_bytes / 2**30


def plan(model: Path, cluster: Path, workload: Path, profiles: list[Path], dtype: str) -> dict:
    from tessel.plan.api import PlanSettings, make_plan

    settings = PlanSettings(solver="dp", overlap=True, dtype=dtype, kv_dtype=dtype)
    return json.loads(make_plan(str(model), str(cluster), str(workload), settings, profiles=profiles)
                      .plan_file().dump())  # fmt: skip


def half_streamed_plan(model: Path, work: Path, cfg: dict, gpu_type: str, host_gbps: float | None) -> dict:
    """The plan on a device whose memory the search sets so half the layers stream (bisection on
    memory_gib: fewer GiB, more layers streamed)."""
    workload = work / "workload.yaml"
    full = plan(model, write_cluster(work / "c.yaml", gpu_type, None, None), workload, cfg["profiles"],
                cfg["dtype"])  # fmt: skip
    stage = full["stages"][0]
    layers = stage["layer_end"] - stage["layer_start"]
    low, high = 1e-4, stage["weights_gib"] + stage["kv_gib"] + 1.0
    best = None
    for _ in range(24):
        middle = (low + high) / 2
        cluster = write_cluster(work / f"c{host_gbps}.yaml", gpu_type, middle, host_gbps)
        try:
            candidate = plan(model, cluster, workload, cfg["profiles"], cfg["dtype"])
        except Exception:  # noqa: BLE001 - the cap too small to plan at all: raise it
            low = middle
            continue
        streamed = _streamed(candidate)
        if streamed == layers // 2:
            best = candidate
            break
        if streamed > layers // 2:
            low = middle
        else:
            high = middle
        if best is None or abs(streamed - layers // 2) < abs(_streamed(best) - layers // 2):
            best = candidate
    return best


def _streamed(plan_json: dict) -> int:
    return len(plan_json["stages"][0].get("offload_layers") or [])


def measure(model: Path, plan_path: Path, cfg: dict, batch: list[list[int]]) -> dict:
    """Run the plan's one stage in process; time every step."""
    import torch

    from tessel import LLM, SamplingParams
    from tessel.pipeline.executor import ProcessExecutor
    from tessel.pipeline.options import RunOptions

    executor = ProcessExecutor(RunOptions(plan_path, model))
    engine = LLM(model, executor=executor, dtype=cfg["torch_dtype"], max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=cfg["new_tokens"], ignore_eos=True)
    engine.generate([batch[0][:8]], SamplingParams(temperature=0.0, max_tokens=2), use_progress=False)
    ids = [f"r{i}" for i in range(len(batch))]
    for rid, prompt in zip(ids, batch, strict=True):
        engine.add_request(rid, prompt, params)
    steps, cpu_steps, exposed, hidden, tokens = [], [], [], [], {}
    while engine.has_unfinished_requests():
        before = (executor.stage.stats.stream_exposed_s, executor.stage.stats.stream_hidden_s)
        started, cpu_started = time.perf_counter(), time.process_time()
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
        if cfg["device"] == "cuda":
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - started)
        cpu_steps.append(time.process_time() - cpu_started)
        exposed.append(executor.stage.stats.stream_exposed_s - before[0])
        hidden.append(executor.stage.stats.stream_hidden_s - before[1])
    stats = executor.stage.stats
    if executor.stage.streamer is not None:
        executor.stage.streamer.close()
    decode = steps[1:]
    return {
        "prefill_ms": steps[0] * 1e3,
        "decode_ms": statistics.median(decode) * 1e3,
        "decode_cpu_ms": statistics.median(cpu_steps[1:]) * 1e3,  # every thread's CPU time
        "decode_steps": len(decode),
        "tok_s": len(batch) * cfg["new_tokens"] / sum(steps),
        "exposed_ms_per_step": statistics.mean(exposed[1:]) * 1e3 if len(exposed) > 1 else 0.0,
        "hidden_ms_per_step": statistics.mean(hidden[1:]) * 1e3 if len(hidden) > 1 else 0.0,
        "stream_layers": stats.stream_layers,
        "stream_copies": stats.stream_copies,
        "stream_copy_bytes": stats.stream_copy_bytes,
        "stream_emulated_s": stats.stream_emulated_s,
        "tokens": [tokens[rid] for rid in ids],
    }


def accelerate_row(model: Path, memory_gib: float, batch: list[list[int]], new: int) -> dict:
    """HF transformers with `device_map="auto"` and the same GPU memory (its offload hooks copy
    the CPU layers' weights in for every forward)."""
    import torch
    from transformers import AutoModelForCausalLM

    memory = {0: f"{memory_gib:.3f}GiB", "cpu": f"{HOST_MEMORY_GIB}GiB"}
    hf = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float16, device_map="auto", max_memory=memory
    )
    placed = sorted({str(v) for v in getattr(hf, "hf_device_map", {}).values()})
    ids = torch.tensor(batch, device="cuda")

    def run() -> None:
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False)  # fmt: skip

    seconds = _harness.time_call(run, warmup=1, repeats=1, clock="cuda-wall").min_s
    return {"tok_s": len(batch) * new / seconds, "placement": placed}


def rel_error(predicted: float | None, measured: float) -> float | None:
    return None if predicted is None or not measured else (predicted - measured) / measured


def run(args: argparse.Namespace, cfg: dict, work: Path, console: Console) -> dict:
    import torch

    from tessel.models.config import ModelConfig

    model = args.model
    vocab = ModelConfig.from_dir(model).vocab_size
    rng = random.Random(0)
    batch = [[rng.randrange(100, vocab) for _ in range(cfg["prompt"])] for _ in range(cfg["requests"])]
    write_workload(work / "workload.yaml", cfg)
    gpu_type = "cpu" if cfg["device"] == "cpu" else args.gpu_type
    if args.profile is None:
        console.print(f"profiling this {cfg['device']} on {model.name}'s layer ...")
        profile = work / "profile.json"
        tessel("profile", "--device", cfg["device"], "--model", str(model), "--scale", "1", "--dtype",
               cfg["torch_dtype"], "--budget-s", str(cfg["profile_budget_s"]), "--threads", str(args.threads),
               "--json", str(profile))  # fmt: skip
        args.profile = profile
    cfg["profiles"] = [args.profile]
    torch.set_num_threads(args.threads)
    resident_plan = plan(model, write_cluster(work / "resident.yaml", gpu_type, None, None),
                         work / "workload.yaml", cfg["profiles"], cfg["dtype"])  # fmt: skip
    resident_path = work / "resident.json"
    resident_path.write_text(json.dumps(resident_plan))
    console.print("running: all layers resident ...")
    resident = measure(model, resident_path, cfg, batch)
    resident.update(predicted_ms=resident_plan["stages"][0]["decode_ms"], host_gbps=None, streamed_layers=[])
    rows = [{"name": "resident", **resident}]
    links = args.host_gbps if cfg["device"] == "cpu" else [None]
    for gbps in links:
        streamed_plan = half_streamed_plan(model, work, cfg, gpu_type, gbps)
        stage = streamed_plan["stages"][0]
        path = work / f"streamed{gbps}.json"
        path.write_text(json.dumps(streamed_plan))
        console.print(f"running: layers {stage['offload_layers']} streamed, host link {gbps} Gbit/s ...")
        row = measure(model, path, cfg, batch)
        row.update(predicted_ms=stage["decode_ms"], host_gbps=gbps, streamed_layers=stage["offload_layers"],
                   memory_gib=stage.get("emulate_memory_gib"), offload_gib=stage["offload_gib"])  # fmt: skip
        if gbps:  # the older rule: only the offloaded bytes over the link, overlapped with compute
            link_ms = stage["offload_gib"] * 2**30 / (gbps * 1e9 / 8) * 1e3  # Gbit/s -> bytes/s
            row["predicted_bytes_ms"] = max(resident["predicted_ms"], link_ms)
        rows.append({"name": f"half streamed @ {gbps} Gbit/s" if gbps else "half streamed", **row})
    for row in rows:
        row["error"] = rel_error(row["predicted_ms"], row["decode_ms"])
        row["error_cpu"] = rel_error(row["predicted_ms"], row["decode_cpu_ms"])
        row["same_tokens"] = row.pop("tokens") == resident["tokens"] if row is not rows[0] else True
    rows[0].pop("tokens", None)
    result = {"config": {k: v for k, v in cfg.items() if k != "profiles"}, "rows": rows}
    if cfg["device"] == "cuda":
        cap = streamed_plan["stages"][0]["weights_gib"] - streamed_plan["stages"][0]["offload_gib"]
        console.print("running: accelerate offload ...")
        result["accelerate"] = accelerate_row(model, cap, batch, cfg["new_tokens"])
        result["vs_accelerate"] = rows[-1]["tok_s"] / result["accelerate"]["tok_s"]
    return result


def render(result: dict, console: Console) -> None:
    table = Table(title="streamed weights: half the layers in host memory vs all resident (one stage)")
    for column in ("config", "streamed", "tok/s", "decode ms", "cpu ms", "pred ms", "err", "err cpu",
                   "pred bytes", "exposed ms/step",
                   "hidden ms/step", "copies", "same tokens"):  # fmt: skip
        table.add_column(column, justify="right")
    for row in result["rows"]:
        error, error_cpu = ("-" if e is None else f"{e:+.0%}" for e in (row["error"], row["error_cpu"]))
        table.add_row(
            row["name"], str(len(row["streamed_layers"])), f"{row['tok_s']:.1f}", f"{row['decode_ms']:.2f}",
            f"{row['decode_cpu_ms']:.2f}", f"{row['predicted_ms']:.2f}", error, error_cpu,
            "-" if row.get("predicted_bytes_ms") is None else f"{row['predicted_bytes_ms']:.2f}",
            f"{row['exposed_ms_per_step']:.2f}",
            f"{row['hidden_ms_per_step']:.2f}", str(row["stream_copies"]), str(row["same_tokens"]),
        )  # fmt: skip
    console.print(table)
    if "accelerate" in result:
        console.print(f"accelerate offload: {result['accelerate']['tok_s']:.1f} tok/s; tessel / accelerate = "
                      f"{result['vs_accelerate']:.2f}x (target >= 2x)")  # fmt: skip
    if result["config"]["device"] == "cpu":
        console.print("CPU rows emulate the host link on one CPU (copies slowed to it): not GPU figures")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke test, not a measurement")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", type=Path, help="HF model directory (default: SmolLM2-135M-Instruct on "
                        "the CPU, Llama-3.2-1B's shapes with random weights on CUDA)")  # fmt: skip
    parser.add_argument(
        "--host-gbps", type=float, nargs="+", default=[16.0, 128.0], help="emulated host links, Gbit/s"
    )
    parser.add_argument("--profile", type=Path, help="this device's `tessel profile` JSON (default: run it)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--gpu-type", help="catalog type of the GPU (default: from its name)")
    _harness.add_record_options(parser, "offload_weights")
    _harness.add_size_options(parser, FULL)
    args = parser.parse_args()
    cfg = _harness.sizes(args, QUICK if args.quick else CUDA if args.device == "cuda" else FULL)
    cfg.update(device=args.device, dtype="fp32" if args.device == "cpu" else "fp16")
    cfg["torch_dtype"] = "float32" if args.device == "cpu" else "float16"
    console = Console(highlight=False)
    console.print(_harness.machine_line())
    load_before = os.getloadavg()
    with _harness.stopwatch() as elapsed, tempfile.TemporaryDirectory(prefix="tessel-offload-bench-") as tmp:
        if args.device == "cuda":
            args.model = args.model or llama_1b(Path(tmp), args.quick)
            args.gpu_type = args.gpu_type or gpu_kind()
        else:
            args.model = _harness.example_model(args.model)
        result = run(args, cfg, Path(tmp), console)
    result.update(model=str(args.model), quick=args.quick, wall_s=elapsed.wall_s,
                  loadavg_before=load_before, loadavg_after=os.getloadavg())  # fmt: skip
    render(result, console)
    _harness.append_record(args.out, "offload_weights", result, args.label)


def llama_1b(root: Path, quick: bool) -> Path:
    """Llama-3.2-1B's shapes with random weights (cuda_engine.py's shapes; 4 layers with --quick)."""
    import cuda_engine

    sizes, kv_heads = cuda_engine.SHAPES["llama-1b"]
    shape = {**sizes, **({"num_hidden_layers": 4} if quick else {})}
    tiny_models = _harness.tests_module("tiny_models")
    return tiny_models.make_tiny_checkpoint(
        root / "llama-1b", "llama", tie_word_embeddings=True, num_kv_heads=kv_heads, seed=0, **shape
    )


def gpu_kind() -> str:
    import torch

    name = torch.cuda.get_device_name(0).upper()
    return next((k for k in ("H200", "H100", "A100", "L4", "T4", "V100") if k in name), name.split()[-1])


if __name__ == "__main__":
    main()
