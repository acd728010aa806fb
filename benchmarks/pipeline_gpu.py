"""Pipelines with GPU stages against one process on the GPU: tokens and tok/s; print a table, write JSON.

    python benchmarks/pipeline_gpu.py [--quick] [--device cuda] [--out benchmarks/results/pipeline_gpu.jsonl]

The model has SmolLM2-135M's shapes with random weights (`benchmarks/cuda_engine.py`'s checkpoint:
the GPU machine has no room for the real one; speed does not depend on the weights' values). Every
configuration runs the same closed batch (`--requests` token-id prompts of 64 tokens, `--new-tokens`
each, greedy, EOS ignored) through `tessel.pipeline.run.run_pipeline` with `warmup=True` (stage 0
captures its CUDA graphs and every stage builds its kernels on untimed requests first):

    single          one process on the GPU (`LLM(device=...)`, `warm_up()`): the oracle and the baseline
    1-stage         a one-stage plan on the GPU: the runtime's overhead
    2 on one GPU    two stages sharing the GPU (pinned host buffers over gloo), 2 micro-batches
    CPU + GPU       `tessel plan --cluster local --gpu-memory-gib CAP`: the planner's split of this
                    machine's CPU and GPU, 2 micro-batches
    CPU alone       one process on the CPU, `--threads` threads
    accelerate      HF transformers with `device_map="auto"` and the same `max_memory` (the CPU's layers
                    offloaded to the GPU per step)

Every configuration runs in `--dtype` (float32 by default, so the CPU's tokens can be held to the
GPU's). `same` counts requests whose tokens equal the single process's (a CPU's arithmetic against the
GPU's, or another batch shape's, may flip a greedy token at a near-tie; the first differing
positions are recorded). `--device cpu` runs the GPU configurations on the CPU (a smoke test of the
script, not a measurement). The record goes to benchmarks/results/pipeline_gpu.jsonl; the figures so
far are kept beside it after each row. `--repredict LABEL` prices a recorded run again with this
tessel (its kept profiles; no GPU): how a change to the cost model moves the recorded errors.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _harness
import torch
from rich.console import Console
from rich.table import Table

PROMPT_TOKENS = 64
MAX_NUM_SEQS = 256  # the scheduler settings `benchmarks/pipeline.py`'s predict simulates
MAX_NUM_BATCHED_TOKENS = 2048


def prompts(count: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab, (count, PROMPT_TOKENS), generator=g).tolist()


def gpu_type(device: str) -> str:
    """The catalog type of the GPU (the plan's `gpu_type` must name it), or cpu."""
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(device).upper()
    for known in ("H200", "H100", "A100", "L4", "T4", "V100", "A10"):
        if known in name:
            return known
    return name.split()[-1]


def write_plan(path: Path, model: Path, stages: list[tuple[str, str, int, int]], m: int) -> Path:
    """A plan file: stages (device, gpu type, layer_start, layer_end)."""
    config = json.loads((model / "config.json").read_text())
    rows = []
    for i, (device, kind, a, b) in enumerate(stages):
        last = i == len(stages) - 1
        rows.append(
            {
                "index": i, "device": device, "gpu_type": kind, "layer_start": a, "layer_end": b,
                "unit_start": a, "unit_end": b,
                "link_to_next": None if last else {"bandwidth_gbps": 100.0, "latency_us": 10.0},
            }
        )  # fmt: skip
    plan = {
        "version": 1,
        "model": {"name": model.name, "config": config},
        "workload": {"m": m},
        "granularity": "layer",
        "stages": rows,
        "predicted": {},
    }
    path.write_text(json.dumps(plan))
    return path


def planner_split(model: Path, cap_gib: float, out: Path) -> Path:
    """`tessel plan --cluster local --gpu-memory-gib CAP` for this machine's CPU and GPU."""
    command = [sys.executable, "-m", "tessel.cli", "plan", "--model", str(model), "--cluster", "local"]
    command += ["--gpu-memory-gib", str(cap_gib), "--solver", "dp", "--json", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return out


def single_row(model: Path, device: str, dtype: str, batch: list[list[int]], new: int, threads: int) -> dict:
    from tessel import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model, device=device, dtype=dtype, max_model_len=512, max_num_seqs=len(batch))
    llm.warm_up()
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate(batch[:2], params, use_progress=False)
    with _harness.stopwatch() as elapsed:
        outputs = llm.generate(batch, params, use_progress=False)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    del llm
    return {"tok_s": len(batch) * new / elapsed.wall_s, "tokens": [o.token_ids for o in outputs]}


def pipeline_row(
    plan: Path, model: Path, dtype: str, prompts_file: Path, new: int, m: int, threads: int
) -> dict:
    from tessel.pipeline.run import RunOptions, run_pipeline

    options = RunOptions(
        plan, model, prompts_file=prompts_file, max_tokens=new, ignore_eos=True, dtype=dtype,
        max_model_len=512, micro_batches=m, threads=threads, warmup=True, cpp=False,
        max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )  # fmt: skip
    run = run_pipeline(options)
    tpot = [r["tpot_s"] for r in run.requests if r["tpot_s"] is not None]
    stages = [
        {k: s.get(k) for k in ("layer_start", "layer_end", "batches", "compute_s", "weight_bytes")}
        for s in run.stages
    ]
    tokens = [r["token_ids"] for r in run.requests]
    return {
        "tok_s": sum(len(t) for t in tokens) / run.wall_s,
        "ttft_s": sum(r["ttft_s"] for r in run.requests) / len(run.requests),
        "tpot_s": sum(tpot) / len(tpot) if tpot else None,
        "tokens": tokens,
        "stages": stages,
    }


def make_profiles(model: Path, device: str, dtype: str, threads: int, budget_s: int, root: Path) -> dict:
    """`tessel profile` of the GPU (decode as CUDA graphs, as the stages replay it) and of the CPU
    (`threads` threads, as the CPU stage runs) on the model, in the runs' dtype -> {device type: path}."""
    paths = {}
    for where, extra in (
        ("cuda" if device.startswith("cuda") else None, []),
        ("cpu", ["--threads", str(threads)]),
    ):
        if where is None:
            continue
        out = root / f"profile-{where}.json"
        command = [
            sys.executable, "-m", "tessel.cli", "profile", "--device", where, "--model", str(model),
            "--scale", "1", "--dtype", dtype, "--budget-s", str(budget_s), "--max-offset", "256",
            "--max-chunk", "2048", "--json", str(out), *extra,
        ]  # fmt: skip
        print(f"-- profiling {where} ({budget_s} s budget for the layer)", flush=True)
        with _harness.stopwatch() as elapsed:
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        print(f"   {elapsed.wall_s:.0f} s", flush=True)  # a run cut short shows where its time went
        paths[json.loads(out.read_text())["device_type"]] = out
    return paths


def predict_row(plan: Path, profiles: dict, requests: int, new: int, m: int) -> dict:
    """The run simulated on the plan priced from the profiles (`benchmarks/pipeline.py`'s predict:
    the same scheduler settings and micro-batches in flight as the run)."""
    import pipeline

    cfg = {"slots": m}
    predicted = pipeline.predict(plan, list(profiles.values()), cfg, PROMPT_TOKENS, new, requests, False)
    return {k: predicted[k] for k in ("ttft_s", "tpot_s", "throughput_tok_s")}


def accelerate_row(model: Path, cap_gib: float, batch: list[list[int]], new: int, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM

    memory = {0: f"{cap_gib}GiB", "cpu": "100GiB"}
    hf = AutoModelForCausalLM.from_pretrained(
        model, dtype=getattr(torch, dtype), device_map="auto", max_memory=memory
    )
    placed = sorted({str(v) for v in getattr(hf, "hf_device_map", {"?": "no hf_device_map"}).values()})
    ids = torch.tensor(batch, device="cuda")

    def run() -> None:
        with torch.no_grad():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
            )

    seconds = _harness.time_call(run, warmup=1, repeats=1, clock="cuda-wall").min_s
    return {"tok_s": len(batch) * new / seconds, "placement": placed}


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    same = sum(g == w for g, w in zip(got, want, strict=True))
    first = [
        next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
        for g, w in zip(got, want, strict=True)
    ]
    return {"same": same, "of": len(want), "first_diff": [f for f in first if f is not None][:8]}


def repredict(label: str, out: Path) -> None:
    """Each measured row of the last record labelled `label` in `out`, predicted again by this
    tessel from the profiles the record kept (after a change to the cost model or the simulator: no
    GPU needed); the plans are rebuilt from the record's stages. Appends a record `<label>_repredicted`."""
    source = _harness.last_record(out, label)
    result = json.loads(json.dumps(source["result"]))
    rows = result["rows"]
    layers = rows["1-stage"]["stages"][-1]["layer_end"]
    kind = next(k for k in result["profiles"] if k != "cpu")
    gpu = "localhost/gpu0"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny_models = _harness.tests_module("tiny_models")
        shape = dict(SMOLLM2_SHAPE, num_hidden_layers=layers)
        model = tiny_models.make_tiny_checkpoint(
            root / "smollm2-shape", "llama", tie_word_embeddings=True, num_kv_heads=3, seed=0, **shape
        )
        profiles = {}
        for name, data in result["profiles"].items():
            profiles[name] = root / f"profile-{name}.json"
            profiles[name].write_text(json.dumps(data))
        half = layers // 2
        plans = {
            "1-stage": ([(gpu, kind, 0, layers)], 1),
            "2 on one GPU": ([(gpu, kind, 0, half), (f"{gpu}#2", kind, half, layers)], 2),
            "CPU + GPU": ([tuple(stage) for stage in result.get("cpu_gpu_plan", {}).get("stages", [])], 2),
        }
        workload = result["workload"]
        for name, (stages, m) in plans.items():
            row = rows.get(name)
            if row is None or "error" in row or not stages:
                continue
            plan = write_plan(root / f"{name}.json", model, stages, m)
            row["predicted"] = predict_row(plan, profiles, workload["requests"], workload["new_tokens"], m)
            row["rel_error"] = {
                k: _rel(row["predicted"][p], row[k])
                for k, p in (("tok_s", "throughput_tok_s"), ("ttft_s", "ttft_s"), ("tpot_s", "tpot_s"))
            }
    result["repredicted_from"] = {
        "label": label,
        "git_sha": source.get("git_sha"),
        "time_utc": source.get("time_utc"),
    }
    _print(result)
    _harness.append_record(out, "pipeline_gpu", result, f"{label}_repredicted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="the GPU (cpu: a smoke run of the script)")
    parser.add_argument("--quick", action="store_true", help="4 layers, 4 requests: a smoke run")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--cap-gib", type=float, default=2.0, help="--gpu-memory-gib of the CPU + GPU plan")
    parser.add_argument("--threads", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--dtype", default="float32", help="every configuration's dtype")
    parser.add_argument("--skip", action="append", default=[], help="configurations to skip (by name)")
    parser.add_argument("--no-predict", action="store_true", help="no profiles, no predicted columns")
    parser.add_argument("--profile-budget-s", type=int, default=20, help="each profile's layer budget")
    parser.add_argument(
        "--repredict", metavar="LABEL", help="predict a recorded run again (no GPU): see repredict"
    )
    _harness.add_record_options(parser, "pipeline_gpu")
    args = parser.parse_args()
    if args.repredict:
        repredict(args.repredict, args.out)
        return
    print(_harness.machine_line())
    cuda = args.device.startswith("cuda")
    kind = gpu_type(args.device)
    index = args.device.split(":")[1] if ":" in args.device else "0"
    gpu = f"localhost/gpu{index}"
    requests, new = (4, 4) if args.quick else (args.requests, args.new_tokens)
    result: dict = {"device": torch.cuda.get_device_name(args.device) if cuda else "cpu", "rows": {}}
    rows = result["rows"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cuda_engine = _harness.tests_module("tiny_models")
        shape = dict(SMOLLM2_SHAPE, num_hidden_layers=4 if args.quick else 30)
        model = cuda_engine.make_tiny_checkpoint(
            root / "smollm2-shape", "llama", tie_word_embeddings=True, num_kv_heads=3, seed=0, **shape
        )
        layers = shape["num_hidden_layers"]
        batch = prompts(requests, shape["vocab_size"])
        prompts_file = root / "prompts.jsonl"
        prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in batch))
        result["workload"] = {"requests": requests, "prompt_tokens": PROMPT_TOKENS, "new_tokens": new}
        refs: dict[str, list] = {}

        profiles: dict = {}
        if not args.no_predict:
            try:
                profiles = make_profiles(
                    model, args.device, args.dtype, args.threads, args.profile_budget_s, root
                )
            except Exception as error:  # noqa: BLE001 - the runs still go on, unpredicted
                result["profile_error"] = f"{type(error).__name__}: {error}"[:500]
            result["profiles"] = {kind: json.loads(path.read_text()) for kind, path in profiles.items()}

        def step(name: str, fn, ref: str | None = None, plan_path: Path | None = None, m: int = 1) -> None:
            if name in args.skip:
                return
            print(f"-- {name}", flush=True)
            try:
                with _harness.stopwatch() as elapsed:
                    row = fn()
            except Exception as error:  # noqa: BLE001 - one failed configuration must not hide the others
                rows[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
                print(f"   failed: {rows[name]['error']}", flush=True)
                return
            tokens = row.pop("tokens", None)
            if ref is not None and tokens is not None and ref in refs:
                row.update(compare(tokens, refs[ref]))
            if tokens is not None and ref is None:
                refs[name] = tokens
            row["seconds"] = elapsed.wall_s
            if plan_path is not None and profiles:
                try:
                    row["predicted"] = predict_row(plan_path, profiles, requests, new, m)
                    row["rel_error"] = {
                        k: _rel(row["predicted"][p], row[k])
                        for k, p in (
                            ("tok_s", "throughput_tok_s"),
                            ("ttft_s", "ttft_s"),
                            ("tpot_s", "tpot_s"),
                        )
                    }
                except Exception as error:  # noqa: BLE001 - the measured row stands without its prediction
                    row["predicted"] = {"error": f"{type(error).__name__}: {error}"[:500]}
            rows[name] = row
            print(f"   {json.dumps(_harness_safe(row))[:400]}", flush=True)
            _harness.save_partial(args.out, "pipeline_gpu", result, args.label)

        half = layers // 2
        plan = lambda name, stages, m=1: write_plan(root / f"{name}.json", model, stages, m)  # noqa: E731
        threads, dtype = args.threads, args.dtype
        step("single", lambda: single_row(model, args.device, dtype, batch, new, threads))
        one = plan("one", [(gpu, kind, 0, layers)])
        step("1-stage", lambda: pipeline_row(one, model, dtype, prompts_file, new, 1, threads), "single", one)
        two = plan("two", [(gpu, kind, 0, half), (f"{gpu}#2", kind, half, layers)], 2)
        step(
            "2 on one GPU",
            lambda: pipeline_row(two, model, dtype, prompts_file, new, 2, threads),
            "single",
            two,
            2,
        )
        if cuda:
            mixed = planner_split(model, args.cap_gib, root / "mixed.json")
        else:
            mixed = plan("mixed", [("localhost-cpu/gpu0", "cpu", 0, half), (gpu, kind, half, layers)], 2)
        stages = json.loads(mixed.read_text())["stages"]
        split = [(s["device"], s["gpu_type"], s["layer_start"], s["layer_end"]) for s in stages]
        result["cpu_gpu_plan"] = {"cap_gib": args.cap_gib, "stages": split}
        step(
            "CPU + GPU",
            lambda: pipeline_row(mixed, model, dtype, prompts_file, new, 2, threads),
            "single",
            mixed,
            2,
        )
        step("CPU alone", lambda: single_row(model, "cpu", dtype, batch, new, threads), "single")
        if cuda:
            step("accelerate offload", lambda: accelerate_row(model, args.cap_gib, batch, new, dtype))
    _print(result)
    _harness.append_record(args.out, "pipeline_gpu", result, args.label)


SMOLLM2_SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "max_position_embeddings": 2048,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
}


def _harness_safe(row: dict) -> dict:
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k != "stages"}


def _print(result: dict) -> None:
    rows = result["rows"]
    base = rows.get("single", {}).get("tok_s")
    table = Table(title=f"pipelines with GPU stages ({result['device']})")
    columns = ("configuration", "tok/s", "vs single", "same tokens", "tok/s pred (err)",
               "TPOT ms meas / pred (err)", "TTFT ms meas / pred (err)", "note")  # fmt: skip
    for column in columns:
        table.add_column(column)
    for name, row in rows.items():
        if "error" in row:
            table.add_row(name, "-", "-", "-", "-", "-", "-", row["error"][:80])
            continue
        ratio = f"{row['tok_s'] / base:.2f}x" if base else "-"
        same = f"{row['same']}/{row['of']}" if "same" in row else "-"
        pred, err = row.get("predicted") or {}, row.get("rel_error") or {}
        note = pred.get("error") or str(row.get("placement", ""))

        predicted_tok_s = (
            f"{pred['throughput_tok_s']:.1f} ({_pct(err.get('tok_s'))})"
            if "throughput_tok_s" in pred
            else "-"
        )
        table.add_row(
            name, f"{row['tok_s']:.1f}", ratio, same, predicted_tok_s, _both(row, "tpot_s"),
            _both(row, "ttft_s"), note[:60],
        )  # fmt: skip
    Console(width=180).print(table)


def _both(row: dict, key: str) -> str:
    """Measured / predicted milliseconds (error) of `key`."""
    pred, err = row.get("predicted") or {}, row.get("rel_error") or {}
    if row.get(key) is None or pred.get(key) is None:
        return "-"
    return f"{row[key] * 1e3:.2f} / {pred[key] * 1e3:.2f} ({_pct(err.get(key))})"


def _rel(predicted: float | None, measured: float | None) -> float | None:
    return None if predicted is None or not measured else (predicted - measured) / measured


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


if __name__ == "__main__":
    main()
