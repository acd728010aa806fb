"""The pipeline runtime's cost and its overlap on this CPU: a one-stage plan against one process, and
two stages against one; print a table, write JSON.

    python benchmarks/pipeline_overhead.py [--quick] [--model DIR] [--requests N] [--new-tokens N]

The same closed batch everywhere (`--requests` token-id prompts of 64 tokens, `--new-tokens` each,
greedy, EOS ignored), SmolLM2-135M float32 (`tessel example-model`), 1 torch thread per process:

    single          the engine in this process (`LLM`), after a warm-up request
    1-stage         a one-stage plan through `tessel.pipeline.run.run_pipeline` (a stage process
                    with one micro-batch): overhead = single / 1-stage, target within 10%
    2-stage m=2     two stages (the planner's split), two micro-batches in flight: overlap =
                    2-stage / 1-stage, target >= 1.6x
    2-stage plan m  the same with the plan's own micro-batches (its workload's m)

A decode step of two micro-batches of n/2 rows costs each stage its half of the layers twice, so at
best the two stages together run n rows in the time one process runs the whole model on n/2 rows:
`bound` = t(n rows) / t(n/2 rows), from single-process decode tok/s at n and n/2 requests. Where a
step's cost hardly grows with its rows (weights streamed from memory), that bound is near 1, not 2.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import _harness
import torch
from rich.console import Console
from rich.table import Table

PROMPT_TOKENS = 64


def write_cluster(path: Path, devices: int) -> Path:
    link = "{bandwidth_gbps: 80, latency_us: 50}"
    path.write_text(
        f"name: cpu{devices}\nnodes:\n  - name: localhost\n    gpus: {{type: cpu, count: {devices}}}\n"
        f"    intra_link: {link}\nnetwork: {link}\n"
    )
    return path


def plan(model: Path, devices: int, root: Path) -> Path:
    out = root / f"plan{devices}.json"
    cluster = write_cluster(root / f"cpu{devices}.yaml", devices)
    command = [sys.executable, "-m", "tessel.cli", "plan", "--model", str(model), "--cluster", str(cluster)]
    subprocess.run(
        [*command, "--solver", "dp", "--dtype", "fp32", "--json", str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out


def single(model: Path, batch: list[list[int]], new: int) -> dict:
    from tessel import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model, dtype="float32", max_num_seqs=len(batch), max_model_len=512, kv_cache_gib=0.5)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate(batch[:2], params, use_progress=False)
    with _harness.stopwatch() as elapsed:
        outputs = llm.generate(batch, params, use_progress=False)
    return {"tok_s": len(batch) * new / elapsed.wall_s, "tokens": [o.token_ids for o in outputs]}


def decode_step_s(model: Path, batch: list[list[int]], new: int) -> dict[int, float]:
    """Seconds per decode step of one process at len(batch) and len(batch) // 2 rows: a run's time
    less a prefill-only run's, over its new - 1 decode steps; one engine, the two sizes timed
    interleaved (best of 3)."""
    from tessel import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model, dtype="float32", max_num_seqs=len(batch), max_model_len=512, kv_cache_gib=0.5)
    sizes = (len(batch), len(batch) // 2)

    def run(rows: int, tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        return lambda: llm.generate(batch[:rows], params, use_progress=False)

    calls = {(rows, tokens): run(rows, tokens) for rows in sizes for tokens in (1, new)}
    timed = _harness.time_calls(calls, warmup=1, repeats=3)
    return {rows: (timed[(rows, new)].min_s - timed[(rows, 1)].min_s) / (new - 1) for rows in sizes}


def staged(plan_path: Path, model: Path, prompts: Path, new: int, requests: int, m: int | None) -> dict:
    from tessel.pipeline.run import RunOptions, run_pipeline

    options = RunOptions(
        plan_path, model, prompts_file=prompts, max_tokens=new, ignore_eos=True, max_num_seqs=requests,
        max_model_len=512, kv_cache_gib=0.5, threads=1, warmup=True, micro_batches=m, cpp=False,
    )  # fmt: skip
    run = run_pipeline(options)
    tokens = [r["token_ids"] for r in run.requests]
    layers = [(s["layer_start"], s["layer_end"]) for s in run.stages]
    compute = [round(s.get("compute_s", 0.0), 2) for s in run.stages]
    return {
        "tok_s": sum(map(len, tokens)) / run.wall_s,
        "tokens": tokens,
        "layers": layers,
        "compute_s": compute,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 requests, 4 tokens: a smoke run")
    parser.add_argument("--model", type=Path, help="HF model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    _harness.add_record_options(parser, "pipeline_overhead")
    args = parser.parse_args()
    model = _harness.example_model(args.model)
    console = Console(highlight=False)
    console.print(_harness.machine_line())
    requests, new = (4, 4) if args.quick else (args.requests, args.new_tokens)
    rng = random.Random(0)
    batch = [[rng.randrange(1000, 20000) for _ in range(PROMPT_TOKENS)] for _ in range(requests)]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prompts = root / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in batch))
        one, two = plan(model, 1, root), plan(model, 2, root)
        plan_m = json.loads(two.read_text())["workload"].get("m")
        rows["single"] = single(model, batch, new)
        rows["1-stage"] = staged(one, model, prompts, new, requests, None)
        rows["2-stage m=2"] = staged(two, model, prompts, new, requests, 2)
        rows[f"2-stage plan m={plan_m}"] = staged(two, model, prompts, new, requests, None)
        step_s = decode_step_s(model, batch, new)
    reference = rows["single"].pop("tokens")
    for row in rows.values():
        tokens = row.pop("tokens", None)
        if tokens is not None:
            row["same_tokens"] = tokens == reference
    result = {
        "model": str(model),
        "workload": {
            "requests": requests,
            "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": new,
            "threads_per_process": 1,
        },
        "rows": rows,
        "overhead": rows["1-stage"]["tok_s"] / rows["single"]["tok_s"],
        "overlap": rows["2-stage m=2"]["tok_s"] / rows["1-stage"]["tok_s"],
        "decode_step_s": {str(rows): seconds for rows, seconds in step_s.items()},
        "bound": step_s[requests] / step_s[requests // 2],  # t(n rows) / t(n/2 rows) of a decode step
    }
    table = Table(
        title=f"pipeline runtime on this CPU ({requests} requests x {new} tokens, 1 thread per process)"
    )
    for column in (
        "run",
        "tok/s",
        "vs single",
        "vs 1-stage",
        "same tokens",
        "stage layers",
        "stage compute s",
    ):
        table.add_column(column)
    for name, row in rows.items():
        table.add_row(
            name, f"{row['tok_s']:.1f}", f"{row['tok_s'] / rows['single']['tok_s']:.2f}x",
            f"{row['tok_s'] / rows['1-stage']['tok_s']:.2f}x", str(row.get("same_tokens", "-")),
            str(row.get("layers", "-")), str(row.get("compute_s", "-")),
        )  # fmt: skip
    console.print(table)
    console.print(
        f"overhead (1-stage / single): {result['overhead']:.2f}x   overlap (2-stage m=2 / 1-stage): "
        f"{result['overlap']:.2f}x   bound t({requests} rows) / t({requests // 2} rows): "
        f"{result['bound']:.2f}x"
    )
    _harness.append_record(args.out, "pipeline_overhead", result, args.label)


if __name__ == "__main__":
    main()
