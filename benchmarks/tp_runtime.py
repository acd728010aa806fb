"""A tensor-parallel engine (TP=2: two processes) against one process, on SmolLM2-135M.

    python benchmarks/tp_runtime.py [--quick] [--requests 32] [--prompt-tokens 128] [--output-tokens 64]
        [--repeats 2] [--out PATH.jsonl] [--label NAME]

Both engines run with one torch thread per process (`torch.set_num_threads(1)`; the TP engine's
follower takes the leader's count), float32, greedy, EOS ignored. The workload: `requests`
concurrent requests of `prompt_tokens` random token ids each, `output_tokens` new tokens each, all
added at once (one `generate` call). Each engine first runs a short untimed warm-up, then the
two engines take turns `repeats` times (a load change on the shared machine hits both alike).
The tokens of every TP run are asserted equal to the one-process run's. Throughput is output
tokens per wall second; the speedup compares the median of each. Each run also records every
rank's CPU seconds (/proc/PID/stat): on a machine whose cores other jobs take, the busiest rank's
CPU seconds say what the split did to the work when the wall time cannot (two ranks need two free
cores at once). SmolLM2 has 9 heads over 3 KV
heads: TP=2 splits them 6 + 3 (two KV heads and one), the MLP columns evenly
(`tessel.parallel.split`). The load average (/proc/loadavg) is read before and after. Appends a
record to benchmarks/results/tp_runtime.jsonl.

With `--simulate`, the simulator predicts both runs first, as the planner would price them: this
CPU profiled by `tessel profile` (float32, one thread, `--profile-budget-s` each) on the model's
layer for one process and, with `--tensor-parallel-size 2`, on the busiest rank's layer (rank 0:
6 heads, 2 KV heads) and vocabulary rows; the rank's shared-memory all-reduce timed here
(`tessel.profiling.all_reduce`) and fitted to the ring formula's latency and bandwidth, which price
the stage's 2 all-reduces a layer, the embedding's and the logits gather. Each engine is one
pipeline stage (the TP one with `TensorParallel(2, fitted link, rank 0's shard)`), the same 32
requests all arriving at once, the engine's scheduler limits (`max_num_seqs` = requests, 2,048 tokens
a step). The table then gives predicted against measured throughput, and the predicted stage busy
seconds against the busiest rank's CPU seconds (load-free where the wall time is not).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness

FULL = {"requests": 32, "prompt_tokens": 128, "output_tokens": 64, "repeats": 2, "profile_budget_s": 60}
QUICK = {"requests": 4, "prompt_tokens": 16, "output_tokens": 8, "repeats": 1, "profile_budget_s": 10}
DEGREE = 2
TOKEN_BUDGET = 2048  # the engine's default max_num_batched_tokens
SEED = 45


def load_average() -> str:
    return Path("/proc/loadavg").read_text().strip()


def workload(vocab: int, settings: dict[str, int]) -> list[list[int]]:
    rng = random.Random(SEED)
    return [
        [rng.randrange(3, vocab) for _ in range(settings["prompt_tokens"])]
        for _ in range(settings["requests"])
    ]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_generate(llm, prompts: list[list[int]], params) -> tuple[dict, list[list[int]]]:  # noqa: ANN001
    """(wall and per-rank CPU seconds of one generate, its tokens)."""
    pids = [os.getpid()] + [proc.pid for proc in getattr(llm.executor, "procs", [])]
    cpu = [process_cpu_s(pid) for pid in pids]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    used = [process_cpu_s(pid) - before for pid, before in zip(pids, cpu, strict=True)]
    return {"wall_s": wall, "cpu_s_per_rank": used}, [o.token_ids for o in outputs]


def run(model: Path, settings: dict[str, int]) -> dict:
    import torch

    from tessel import LLM, SamplingParams

    torch.set_num_threads(1)
    params = SamplingParams(temperature=0, max_tokens=settings["output_tokens"], ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    common = {
        "max_model_len": settings["prompt_tokens"] + settings["output_tokens"] + 16,
        "max_num_seqs": settings["requests"],
        "enable_prefix_caching": False,  # a repeat computes its prompts again
    }
    engines = {
        "one process": LLM(str(model), **common),
        "TP=2": LLM(str(model), tensor_parallel_size=2, **common),
    }
    prompts = workload(engines["one process"].model_config.vocab_size, settings)
    for llm in engines.values():
        llm.generate(prompts[:2], warm)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(settings["repeats"]):
        for name, llm in engines.items():
            timing, out = timed_generate(llm, prompts, params)
            runs[name].append(timing)
            tokens.setdefault(name, out)
            assert out == tokens[name], f"{name}: a repeat gave other tokens"
    same = tokens["TP=2"] == tokens["one process"]
    for llm in engines.values():
        llm.shutdown()
    out_tokens = settings["requests"] * settings["output_tokens"]
    rows = {}
    for name, timings in runs.items():
        wall = statistics.median(t["wall_s"] for t in timings)
        busiest = statistics.median(max(t["cpu_s_per_rank"]) for t in timings)
        rows[name] = {
            "runs": timings,
            "median_wall_s": wall,
            "tok_per_s": out_tokens / wall,
            "busiest_rank_cpu_s": busiest,
        }
    one, tp = rows["one process"], rows["TP=2"]
    return {
        "settings": settings,
        "engines": rows,
        "speedup_wall": one["median_wall_s"] / tp["median_wall_s"],
        "speedup_busiest_rank_cpu": one["busiest_rank_cpu_s"] / tp["busiest_rank_cpu_s"],
        "same_tokens": same,
    }


def profile(model: Path, settings: dict[str, int], out: Path, degree: int) -> Path:
    """`tessel profile` of this CPU on the model's layer (degree 1) or its rank 0's (degree > 1)."""
    budget = str(settings["profile_budget_s"])
    offset = str(settings["prompt_tokens"] + settings["output_tokens"])
    args = ["profile", "--device", "cpu", "--model", str(model), "--scale", "1", "--dtype", "float32"]
    args += ["--budget-s", budget, "--max-offset", offset, "--max-chunk", str(TOKEN_BUDGET)]
    args += ["--tensor-parallel-size", str(degree)] if degree > 1 else []
    subprocess.run(
        [sys.executable, "-m", "tessel.cli", *args, "--json", str(out)], check=True, stdout=subprocess.DEVNULL
    )
    return out


def rank_shard(model: Path, spec, degree: int):  # noqa: ANN001, ANN201
    """The cost model's shard of rank 0 of the engine's split (`tessel.parallel.split`)."""
    from tessel.cost.tensor_parallel import uneven_rank_model
    from tessel.models.config import ModelConfig
    from tessel.parallel.split import TPSplit

    rank = TPSplit.of(ModelConfig.from_dir(model), degree).shards[0]
    return uneven_rank_model(
        spec,
        degree,
        heads=rank.num_heads,
        kv_heads=rank.num_kv_heads,
        intermediate_size=rank.intermediate_size,
    )


def predict(model: Path, settings: dict[str, int], profile_path: Path, tp) -> dict:  # noqa: ANN001
    """The simulator's run of the workload on one stage holding every layer (`tp`: its TensorParallel)."""
    from tessel.catalog.models import load_model
    from tessel.chunk.from_plan import StageSpec, build_pipeline
    from tessel.cost.profile import load_profile
    from tessel.sim import SimConfig, SimSchedulerConfig, compute_metrics, simulate
    from tessel.sim.requests import Request

    spec = load_model(str(model))
    stage = StageSpec("cpu0", "cpu", 0, spec.num_layers, None, node="localhost", tp=tp)
    profiles = [load_profile(profile_path)]
    priced = build_pipeline(spec, [stage], dtype="fp32", kv_dtype="fp32", profiles=profiles)
    last = priced.pipeline.stages[-1]
    scheduler = SimSchedulerConfig(max_num_seqs=settings["requests"], max_num_batched_tokens=TOKEN_BUDGET)
    config = SimConfig(scheduler, max_in_flight=1, logits_time_s=last.logits_time_s)
    n, prompt, output = settings["requests"], settings["prompt_tokens"], settings["output_tokens"]
    result = simulate(priced.pipeline, [Request(i, 0.0, prompt, output) for i in range(n)], config)
    metrics = compute_metrics(result)
    return {
        "tok_per_s": metrics.throughput_tok_s,
        "makespan_s": n * output / metrics.throughput_tok_s,
        "ttft_s": metrics.ttft_s.mean,
        "tpot_s": metrics.tpot_s.mean,
        "stage_busy_s": metrics.stage_busy_s[0],
    }


def predictions(model: Path, settings: dict[str, int], work: Path) -> dict:
    """Both engines' predictions (module docstring), with the all-reduce timing and its fitted link."""
    from tessel.catalog.models import load_model
    from tessel.cost.tensor_parallel import TensorParallel
    from tessel.models.config import ModelConfig
    from tessel.profiling.all_reduce import measure_shm_all_reduce

    print("timing the shared-memory all-reduce ...", flush=True)
    timing = measure_shm_all_reduce(DEGREE, ModelConfig.from_dir(model).hidden_size)
    print(
        f"profiling this CPU ({settings['profile_budget_s']} s each, one process and rank 0 of {DEGREE}) ..."
    )
    one = profile(model, settings, work / "profile-tp1.json", 1)
    rank = profile(model, settings, work / f"profile-tp{DEGREE}.json", DEGREE)
    spec = load_model(str(model))
    tp = TensorParallel(DEGREE, timing.link(), rank_shard(model, spec, DEGREE))
    return {
        "all_reduce": timing.to_json(),
        "one process": predict(model, settings, one, None),
        f"TP={DEGREE}": predict(model, settings, rank, tp),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run with tiny settings, not a measurement"
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="the model directory (default: SmolLM2-135M)"
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="also predict both runs with the simulator (profiles this CPU)",
    )
    _harness.add_size_options(parser, FULL)
    _harness.add_record_options(parser, "tp_runtime")
    args = parser.parse_args()
    settings = _harness.sizes(args, QUICK if args.quick else FULL)
    print(_harness.machine_line())
    before = load_average()
    print(f"load average before: {before}")
    model = _harness.example_model(args.model)
    predicted = None
    if args.simulate:
        with tempfile.TemporaryDirectory(prefix="tessel-tp-bench-") as work:
            predicted = predictions(model, settings, Path(work))
    result = run(model, settings)
    after = load_average()
    if predicted is not None:
        result["predicted"] = predicted
        render_predictions(result)
    result["loadavg_before"], result["loadavg_after"] = before, after
    print(
        f"{'engine':<12} {'median wall s':>14} {'tok/s':>8} {'busiest rank CPU s':>19}"
        "  runs: wall s (CPU s per rank)"
    )
    for name, row in result["engines"].items():
        runs = "; ".join(
            f"{r['wall_s']:.2f} ({', '.join(f'{c:.2f}' for c in r['cpu_s_per_rank'])})" for r in row["runs"]
        )
        print(
            f"{name:<12} {row['median_wall_s']:>14.2f} {row['tok_per_s']:>8.1f} "
            f"{row['busiest_rank_cpu_s']:>19.2f}  {runs}"
        )
    print(
        f"TP=2 / one process: {result['speedup_wall']:.2f}x by wall time, "
        f"{result['speedup_busiest_rank_cpu']:.2f}x by the busiest rank's CPU seconds; "
        f"same tokens: {result['same_tokens']}"
    )
    print(f"load average after: {after}")
    _harness.append_record(args.out, "tp_runtime", result, args.label)
    if not result["same_tokens"]:
        raise SystemExit("TP=2 gave other tokens than one process")


def render_predictions(result: dict) -> None:
    link = result["predicted"]["all_reduce"]
    print(
        f"shared-memory all-reduce, fitted: latency {link['fitted_latency_us']:.1f} us, "
        f"bandwidth {link['fitted_bandwidth_gbps']:.1f} Gb/s"
    )
    print(
        f"{'engine':<12} {'pred tok/s':>10} {'meas tok/s':>10} {'error':>7} "
        f"{'pred busy s':>11} {'busiest CPU s':>13} {'error':>7}"
    )
    errors = {}
    for name, row in result["engines"].items():
        pred = result["predicted"][name]
        tok = pred["tok_per_s"] / row["tok_per_s"] - 1
        cpu = pred["stage_busy_s"] / row["busiest_rank_cpu_s"] - 1
        errors[name] = {"throughput": tok, "busy_vs_cpu": cpu}
        print(
            f"{name:<12} {pred['tok_per_s']:>10.1f} {row['tok_per_s']:>10.1f} {tok:>+7.1%} "
            f"{pred['stage_busy_s']:>11.2f} {row['busiest_rank_cpu_s']:>13.2f} {cpu:>+7.1%}"
        )
    result["prediction_errors"] = errors


if __name__ == "__main__":
    main()
