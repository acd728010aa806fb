"""The single-GPU engine against the simulator: predicted vs measured TPOT and throughput on CUDA.

    python benchmarks/fidelity_cuda.py [--shapes smollm2 llama-1b] [--modes graphs eager] \
        [--concurrency 1 8 32] [--quick] [--label NAME] [--out benchmarks/results/fidelity_cuda.jsonl]

The GPU counterpart of `benchmarks/fidelity.py` (issue 30, item 5 and the target "single-GPU engine
TPOT within 10%"). For each model shape (random weights with SmolLM2-135M's or Llama-3.2-1B's
sizes, `benchmarks/cuda_engine.py`'s SHAPES: the GPU machine has no network, and speed does not
depend on the weights' values) and each engine mode:

1. `tessel profile --device cuda --model DIR --scale 1 --dtype bfloat16`: the decoder layer (decode
   points replayed as CUDA graphs for the `graphs` mode, `--eager` for the `eager` one), embedding,
   LM head + sampling, engine step overhead and transport, with held-out errors.
2. For each concurrency n: n requests of the same prompt and output length (`ignore_eos`, greedy)
   arrive at once at one `LLMEngine` on the GPU (bfloat16; CUDA graphs on, or `enforce_eager`),
   after `warm_up()` and an untimed run; TTFT, TPOT and throughput as `fidelity.py` measures them.
3. The same requests simulated on a one-stage pipeline of the GPU's catalog type priced from that
   profile (`tessel.chunk.from_plan.build_pipeline`, `tessel.sim.simulate`).

`--device cpu` runs the script's logic on the CPU with a tiny shape (a smoke test, not a
measurement). Prints a table and appends a record to benchmarks/results/fidelity_cuda.jsonl; the rows so
far are kept beside it after each shape. `--repredict LABEL` prices a recorded run again with this
tessel (its kept profiles; no GPU).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import _harness
import fidelity
from rich.console import Console
from rich.table import Table

FULL = {"prompt": 128, "output": 64, "profile_budget_s": 20, "repeats": 3}  # 3: a median past one outlier run
QUICK = {"prompt": 16, "output": 4, "profile_budget_s": 4, "repeats": 1}
SMOKE_SHAPE = {  # --device cpu: the script's logic on a layer the CPU times in seconds
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
}  # fmt: skip
DTYPE = {"cuda": ("bfloat16", "bf16"), "cpu": ("float32", "fp32")}  # engine / profile name, cost name


def build_checkpoint(root: Path, shape_name: str, device: str) -> Path:
    import cuda_engine

    tiny_models = _harness.tests_module("tiny_models")
    if device == "cpu":
        sizes, kv_heads = SMOKE_SHAPE, 2
    else:
        sizes, kv_heads = cuda_engine.SHAPES[shape_name]
    return tiny_models.make_tiny_checkpoint(
        root / shape_name, "llama", tie_word_embeddings=True, num_kv_heads=kv_heads, seed=0, **sizes
    )


def make_profile(model: Path, device: str, mode: str, cfg: dict, out: Path) -> dict:
    command = [
        sys.executable, "-m", "tessel.cli", "profile", "--device", device, "--model", str(model),
        "--scale", "1", "--dtype", DTYPE[device][0], "--threads", "1",
        "--budget-s", str(cfg["profile_budget_s"]), "--max-offset", str(cfg["prompt"] + cfg["output"] + 64),
        "--max-chunk", str(max(256, cfg["prompt"])), "--json", str(out),
    ]  # fmt: skip
    if device == "cuda":
        command.append("--eager" if mode == "eager" else "--cuda-graphs")
    done = subprocess.run(command, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    print(done.stderr, file=sys.stderr, end="")  # a failed graph capture warns here
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-300:]}")
    return json.loads(out.read_text())


def measure(model: Path, device: str, mode: str, n: int, cfg: dict, vocab: int) -> dict:
    import statistics

    from tessel.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        model,
        device=device,
        dtype=DTYPE[device][0],
        enforce_eager=mode == "eager",
        max_num_seqs=max(n, 1),
        max_model_len=cfg["prompt"] + cfg["output"] + 8,
        enable_prefix_caching=False,
    )
    engine.warm_up()
    warm = fidelity.prompts(n, cfg["prompt"], vocab, 99)
    fidelity.measure_once(engine, warm, min(cfg["output"], 4), "warm")  # untimed
    runs = [
        fidelity.measure_once(engine, fidelity.prompts(n, cfg["prompt"], vocab, r), cfg["output"], f"r{r}")
        for r in range(cfg["repeats"])
    ]
    keys = ("ttft_s", "tpot_s", "throughput_tok_s", "wall_s")
    median = {k: statistics.median(run[k] for run in runs) if runs[0][k] is not None else None for k in keys}
    try:  # after the timed runs: synchronising perturbs them
        median["step_split"] = fidelity.split_steps(
            engine, fidelity.prompts(n, cfg["prompt"], vocab, 7), cfg["output"]
        )
    except Exception as error:  # noqa: BLE001 - a diagnostic only
        median["step_split"] = {"error": f"{type(error).__name__}: {error}"[:300]}
    del engine
    _free(device)
    return median | {"runs": runs}


def _free(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def predict(model: Path, profile_path: Path, device: str, n: int, cfg: dict) -> dict:
    from tessel.catalog.models import load_model
    from tessel.chunk.from_plan import StageSpec, build_pipeline
    from tessel.cost.profile import load_profile
    from tessel.sim import SimConfig, SimSchedulerConfig, compute_metrics, simulate
    from tessel.sim.requests import Request

    spec = load_model(str(model))
    profile = load_profile(profile_path)
    stage = StageSpec("localhost/gpu0", profile.device_type, 0, spec.num_layers, None, node="localhost")
    cost_dtype = DTYPE[device][1]
    priced = build_pipeline(spec, [stage], dtype=cost_dtype, kv_dtype=cost_dtype, profiles=[profile])
    last = priced.pipeline.stages[-1]
    budget = fidelity.MAX_NUM_BATCHED_TOKENS
    scheduler = SimSchedulerConfig(max_num_seqs=max(n, 1), max_num_batched_tokens=budget)
    config = SimConfig(scheduler, max_in_flight=1, logits_time_s=last.logits_time_s)
    requests = [Request(i, 0.0, cfg["prompt"], cfg["output"]) for i in range(n)]
    metrics = compute_metrics(simulate(priced.pipeline, requests, config))
    tpot = metrics.tpot_s.mean
    return {
        "gpu_type": profile.device_type,
        "ttft_s": metrics.ttft_s.mean,
        "tpot_s": None if tpot != tpot else tpot,
        "throughput_tok_s": metrics.throughput_tok_s,
        "step_parts_s": {
            "embed": last._embed_time_s(n),
            "head": last.logits_time_s(n),
            "step": last.step_time_s(n),
        },
    }


def run_shape(shape: str, args, cfg: dict, work: Path, console: Console, rows: list, started: float) -> None:  # noqa: ANN001
    """Append `shape`'s rows to `rows`, the record so far saved beside `--out` after each (a step cut
    short by its time limit keeps what it measured)."""
    from tessel.models.config import ModelConfig

    model = build_checkpoint(work, shape, args.device)
    vocab = ModelConfig.from_dir(model).vocab_size

    def keep(row: dict) -> None:
        rows.append(row)
        _harness.save_partial(args.out, "fidelity_cuda", {"config": cfg, "rows": rows}, args.label)

    for mode in args.modes:
        profile_path = work / f"profile-{shape}-{mode}.json"
        console.print(f"{shape}, {mode}: profiling ({cfg['profile_budget_s']} s budget for the layer) ...")
        try:
            profile = make_profile(model, args.device, mode, cfg, profile_path)
        except Exception as error:  # noqa: BLE001 (one failed profile: the other modes still run)
            keep({"shape": shape, "mode": mode, "error": f"profile: {error}"})
            continue
        keep({"shape": shape, "mode": mode, "profile": profile})  # kept for offline analysis
        heldout = {"layer_prefill": float(profile["meta"]["prefill_heldout_rel_error"]),
                   "layer_decode": float(profile["meta"]["decode_heldout_rel_error"])}  # fmt: skip
        heldout |= {name: fit["heldout_rel_error"] for name, fit in profile["components"].items()}
        for n in args.concurrency:
            console.print(f"{shape}, {mode}: {n} concurrent requests ...")
            row = {"shape": shape, "mode": mode, "concurrency": n, "heldout_rel_error": heldout,
                   "decode_timing": profile["meta"].get("decode_timing")}  # fmt: skip
            try:
                row["measured"] = measure(model, args.device, mode, n, cfg, vocab)
                row["predicted"] = predict(model, profile_path, args.device, n, cfg)
            except Exception as error:  # noqa: BLE001 (kept in the record; the next row still runs)
                row["error"] = f"{type(error).__name__}: {error}"
                console.print(traceback.format_exc())
                keep(row)
                continue
            row["rel_error"] = {
                k: fidelity.rel_error(row["predicted"][k], row["measured"][k])
                for k in ("ttft_s", "tpot_s", "throughput_tok_s")
            }
            keep(row)
            console.print(f"   {_summary(row)} ({time.perf_counter() - started:.0f} s so far)")


def _summary(row: dict) -> str:
    """One line per measured row for the log: a run cut short still shows what it measured."""
    p, m = row["predicted"], row["measured"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.2f}"

    return (
        f"TPOT ms pred {ms(p['tpot_s'])} / meas {ms(m['tpot_s'])}, "
        f"tok/s pred {p['throughput_tok_s']:.0f} / meas {m['throughput_tok_s']:.0f}"
    )


def render(rows: list[dict], console: Console) -> None:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.2f}"

    def pct(v):
        return "-" if v is None else f"{v * 100:+.1f}%"

    table = Table(title="single-GPU engine: simulator prediction vs measured (medians of repeats)")
    for column in ("shape", "mode", "requests", "TPOT ms pred/meas", "err TPOT", "tok/s pred/meas",
                   "err tok/s", "TTFT ms pred/meas", "err TTFT"):  # fmt: skip
        table.add_column(column, justify="right")
    for r in rows:
        if "profile" in r:
            continue
        if "error" in r:
            table.add_row(r["shape"], r["mode"], str(r.get("concurrency", "-")), r["error"][:60], *["-"] * 5)
            continue
        p, m, e = r["predicted"], r["measured"], r["rel_error"]
        table.add_row(
            r["shape"], r["mode"], str(r["concurrency"]), f"{ms(p['tpot_s'])} / {ms(m['tpot_s'])}",
            pct(e["tpot_s"]), f"{p['throughput_tok_s']:.0f} / {m['throughput_tok_s']:.0f}",
            pct(e["throughput_tok_s"]), f"{ms(p['ttft_s'])} / {ms(m['ttft_s'])}", pct(e["ttft_s"]),
        )  # fmt: skip
    console.print(table)
    seen = set()
    for r in rows:
        if "heldout_rel_error" in r and (r["shape"], r["mode"]) not in seen:
            seen.add((r["shape"], r["mode"]))
            errors = ", ".join(f"{k} {v:.1%}" for k, v in r["heldout_rel_error"].items())
            console.print(f"profile held-out error, {r['shape']} {r['mode']}: {errors}")


def repredict(label: str, out: Path, console: Console) -> None:
    """The last record labelled `label` in `out`, its measured rows predicted again by this tessel
    from the profiles it kept (no GPU: after a change to the cost model or the simulator); appends a
    record `<label>_repredicted`."""
    record = _harness.last_record(out, label)
    source = record["result"]
    cfg, device, rows = source["config"], source["device"], []
    with tempfile.TemporaryDirectory(prefix="tessel-fidelity-cuda-") as tmp:
        work, models, profiles = Path(tmp), {}, {}
        for row in source["rows"]:
            key = (row["shape"], row["mode"])
            if "profile" in row:
                profiles[key] = work / f"profile-{row['shape']}-{row['mode']}.json"
                profiles[key].write_text(json.dumps(row["profile"]))
                continue
            if "measured" not in row or key not in profiles:
                continue
            if row["shape"] not in models:
                models[row["shape"]] = build_checkpoint(work, row["shape"], device)
            row = dict(
                row, predicted=predict(models[row["shape"]], profiles[key], device, row["concurrency"], cfg)
            )
            row["rel_error"] = {
                k: fidelity.rel_error(row["predicted"][k], row["measured"][k])
                for k in ("ttft_s", "tpot_s", "throughput_tok_s")
            }
            rows.append(row)
    render(rows, console)
    result = dict(source, rows=rows, repredicted_from={"label": label, "git_sha": record.get("git_sha")})
    _harness.append_record(out, "fidelity_cuda", result, f"{label}_repredicted")


def main() -> None:
    import cuda_engine

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke test, not a measurement")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shapes", nargs="+", choices=sorted(cuda_engine.SHAPES), default=["smollm2"])
    parser.add_argument("--modes", nargs="+", choices=("graphs", "eager"), default=["graphs", "eager"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(fidelity.CONCURRENCY))
    _harness.add_record_options(parser, "fidelity_cuda")
    _harness.add_size_options(parser, FULL)
    parser.add_argument(
        "--repredict", metavar="LABEL", help="predict a recorded run again (no GPU): see repredict"
    )
    args = parser.parse_args()
    cfg = _harness.sizes(args, QUICK if args.quick else FULL)
    console = Console(highlight=False, width=150)
    if args.repredict:
        repredict(args.repredict, args.out, console)
        return
    console.print(_harness.machine_line())
    rows: list[dict] = []
    with _harness.stopwatch() as elapsed, tempfile.TemporaryDirectory(prefix="tessel-fidelity-cuda-") as tmp:
        for shape in args.shapes:
            run_shape(shape, args, cfg, Path(tmp), console, rows, time.perf_counter())
    render(rows, console)
    result = {"config": cfg, "device": args.device, "gpu": _gpu_name(args.device), "rows": rows,
              "quick": args.quick, "wall_s": elapsed.wall_s}  # fmt: skip
    _harness.append_record(args.out, "fidelity_cuda", result, args.label)


def _gpu_name(device: str) -> str | None:
    import torch

    if device != "cuda" or not torch.cuda.is_available():
        return None

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    main()
