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
heads: TP=2 splits them 6 + 3 (two KV heads and one), the MLP columns balanced against that
(`tessel.parallel.split`). The load average (/proc/loadavg) is read before and after. Appends a
record to benchmarks/results/tp_runtime.jsonl.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import _harness

FULL = {"requests": 32, "prompt_tokens": 128, "output_tokens": 64, "repeats": 2}
QUICK = {"requests": 4, "prompt_tokens": 16, "output_tokens": 8, "repeats": 1}
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
    _harness.add_size_options(parser, FULL)
    _harness.add_record_options(parser, "tp_runtime")
    args = parser.parse_args()
    settings = _harness.sizes(args, QUICK if args.quick else FULL)
    print(_harness.machine_line())
    before = load_average()
    print(f"load average before: {before}")
    result = run(_harness.example_model(args.model), settings)
    after = load_average()
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


if __name__ == "__main__":
    main()
