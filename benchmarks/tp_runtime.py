"""A tensor-parallel engine (TP=2: two processes) against one process, on SmolLM2-135M.

    python benchmarks/tp_runtime.py [--quick] [--requests 32] [--prompt-tokens 128] [--output-tokens 64]
        [--repeats 2] [--out PATH.jsonl] [--label NAME]

Both engines run with one torch thread per process (`torch.set_num_threads(1)`; the TP engine's
follower takes the leader's count), float32, greedy, EOS ignored. The workload: `requests`
concurrent requests of `prompt_tokens` random token ids each, `output_tokens` new tokens each, all
added at once (one `generate` call). Each engine first runs a short untimed warm-up, then the
two engines take turns `repeats` times (a load change on the shared machine hits both alike).
The tokens of every TP run are asserted equal to the one-process run's. Throughput is output
tokens per wall second; the speedup compares the median of each. SmolLM2 has 9 heads over 3 KV
heads: TP=2 splits them 6 + 3 (two KV heads and one), the MLP columns balanced against that
(`tessel.parallel.split`). The load average (/proc/loadavg) is read before and after. Appends a
record to benchmarks/results/tp_runtime.jsonl.
"""

from __future__ import annotations

import argparse
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


def timed_generate(llm, prompts: list[list[int]], params) -> tuple[float, list[list[int]]]:  # noqa: ANN001
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - started, [o.token_ids for o in outputs]


def run(model: Path, settings: dict[str, int]) -> dict:
    import torch

    from tessel import LLM, SamplingParams

    torch.set_num_threads(1)
    params = SamplingParams(temperature=0, max_tokens=settings["output_tokens"], ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    max_len = settings["prompt_tokens"] + settings["output_tokens"] + 16
    engines = {
        "one process": LLM(str(model), max_model_len=max_len, max_num_seqs=settings["requests"]),
        "TP=2": LLM(
            str(model), max_model_len=max_len, max_num_seqs=settings["requests"], tensor_parallel_size=2
        ),
    }
    prompts = workload(engines["one process"].model_config.vocab_size, settings)
    for llm in engines.values():
        llm.generate(prompts[:2], warm)
    walls: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(settings["repeats"]):
        for name, llm in engines.items():
            wall, out = timed_generate(llm, prompts, params)
            walls[name].append(wall)
            tokens.setdefault(name, out)
            assert out == tokens[name], f"{name}: a repeat gave other tokens"
    same = tokens["TP=2"] == tokens["one process"]
    for llm in engines.values():
        llm.shutdown()
    out_tokens = settings["requests"] * settings["output_tokens"]
    rows = {
        name: {
            "wall_s": w,
            "median_wall_s": statistics.median(w),
            "tok_per_s": out_tokens / statistics.median(w),
        }
        for name, w in walls.items()
    }
    speedup = rows["one process"]["median_wall_s"] / rows["TP=2"]["median_wall_s"]
    return {"settings": settings, "engines": rows, "speedup": speedup, "same_tokens": same}


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
    print(f"{'engine':<12} {'median wall s':>14} {'tok/s':>8}  runs (s)")
    for name, row in result["engines"].items():
        runs = ", ".join(f"{w:.2f}" for w in row["wall_s"])
        print(f"{name:<12} {row['median_wall_s']:>14.2f} {row['tok_per_s']:>8.1f}  {runs}")
    print(f"speedup TP=2 / one process: {result['speedup']:.2f}x; same tokens: {result['same_tokens']}")
    print(f"load average after: {after}")
    _harness.append_record(args.out, "tp_runtime", result, args.label)
    if not result["same_tokens"]:
        raise SystemExit("TP=2 gave other tokens than one process")


if __name__ == "__main__":
    main()
