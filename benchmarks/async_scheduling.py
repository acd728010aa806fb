"""Async scheduling against the engine without it (issue 47): decode step time and tokens, on the
tiny model whose forward is mostly Python (host_step.py's: 2 layers, hidden 64) and on SmolLM2-135M,
whose forward is mostly arithmetic, float32, one thread.

    python benchmarks/async_scheduling.py [--running 1,16,64] [--steps 40] [--rounds 3] \
        [--models tiny,smollm2] [--device cuda --dtype float16] [--out PATH.jsonl]
    python benchmarks/async_scheduling.py --plan [--plan-requests 8] [--plan-output 64] [--rounds 3]

For each model and count of running requests (16 prompt tokens, greedy, `ignore_eos`, long enough
never to finish), an engine of each kind is built in turn for `--rounds` rounds; each runs 6 steps
untimed, then `--steps` steps, wall time each; a figure is the median step over its rounds' steps.
`speedup` = without / with. `same_tokens`: each request's tokens equal between the two engines in
every round. `steps_ahead`: the decode steps launched before the last one's tokens were applied.

`--plan` (instead of the one-process rows): a 2-stage plan of SmolLM2 on this machine's CPUs
(`tessel plan` over benchmarks/pipeline.py's "2-stage" cluster, no profile), `--plan-requests`
requests of 64 random prompt tokens and `--plan-output` new tokens each (`ignore_eos`), run by
`tessel launch`'s path (`run_pipeline`: stage 1 in its own process, one thread each) without and
with async scheduling (stage 0's decode micro-batches on its worker thread), `--rounds` rounds
interleaved: throughput (output tokens over the run's wall time) and mean TPOT, medians over the
rounds, and whether every request's tokens are equal.

What it shows on a CPU: whether the host's work, overlapped with a forward on a worker thread,
comes off the step. The forward holds the GIL for its Python and frees it in its kernels, so the
overlap pays only where the kernels are most of the forward and the host's work a visible share of
the step; a GPU's forward is kernels the host only launches (not measured here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import _harness
import host_step

PROMPT_TOKENS = 16
WARM_STEPS = 6


def decode_steps(
    model: Path, running: int, steps: int, overlap: bool, device: str = "cpu", dtype: str = "float32"
) -> tuple[list[float], list, int]:
    """(each timed step's wall seconds, each request's tokens, steps launched ahead)."""
    from tessel import LLM, SamplingParams

    max_tokens = WARM_STEPS + steps + 8
    llm = LLM(
        str(model),
        max_num_seqs=running,
        max_model_len=PROMPT_TOKENS + max_tokens + 8,
        async_scheduling=overlap,
        device=device,
        dtype=dtype,
    )
    llm.warm_up()  # the graphs, before the timed steps
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(running):
        llm.add_request(f"r{i}", [5 + (i + k) % 200 for k in range(PROMPT_TOKENS)], params)
    final: dict[str, list[int]] = {}

    def step() -> None:
        for out in llm.step():
            if out.finished:
                final[out.request_id] = list(out.token_ids)

    for _ in range(WARM_STEPS):
        step()
    wall = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        wall.append(time.perf_counter() - started)
    while llm.has_unfinished_requests():
        step()
    ahead = llm.num_steps_ahead
    llm.shutdown()
    return wall, [final[f"r{i}"] for i in range(running)], ahead


def measure(model: Path, running: int, steps: int, rounds: int, device: str, dtype: str) -> dict:
    walls: dict[bool, list[float]] = {False: [], True: []}
    same, ahead = True, 0
    for _ in range(rounds):
        tokens = {}
        for overlap in (False, True):
            wall, tokens[overlap], steps_ahead = decode_steps(model, running, steps, overlap, device, dtype)
            walls[overlap] += wall
            ahead += steps_ahead if overlap else 0
        same = same and tokens[False] == tokens[True]
    without, with_ = (statistics.median(walls[k]) * 1e3 for k in (False, True))
    return {
        "running": running,
        "step_ms_without": without,
        "step_ms_with": with_,
        "speedup": without / with_,
        "same_tokens": same,
        "steps_ahead": ahead,
    }


def plan_rounds(model: Path, args: argparse.Namespace, work: Path) -> dict:
    """The 2-stage plan without and with async scheduling, `args.rounds` interleaved rounds."""
    import pipeline as bench_pipeline  # benchmarks/pipeline.py: its cluster, workload and prompts
    from tessel.models.config import ModelConfig
    from tessel.pipeline.run import RunOptions, run_pipeline

    cfg = {"requests": args.plan_requests, "prompt": 64, "output": args.plan_output, "slots": 2}
    cluster = bench_pipeline.write_cluster(
        work / "cluster.yaml", "local-cpu-2-stage", bench_pipeline.CLUSTERS["2-stage"]
    )
    workload = bench_pipeline.write_workload(work / "workload.yaml", cfg)
    plan = work / "plan.json"
    bench_pipeline.tessel(
        "plan", "--model", str(model), "--cluster", str(cluster), "--workload", str(workload),
        "--solver", "dp", "--dtype", "fp32", "--kv-dtype", "fp32", "--json", str(plan),
    )  # fmt: skip
    vocab = ModelConfig.from_dir(model).vocab_size
    requests = bench_pipeline.prompts_file(work / "requests.jsonl", cfg["requests"], cfg["prompt"], vocab, 0)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.rounds):
        for overlap in (False, True):
            options = RunOptions(
                plan, model, prompts_file=requests, max_tokens=cfg["output"], ignore_eos=True,
                max_num_seqs=256, max_model_len=cfg["prompt"] + cfg["output"] + 8, kv_cache_gib=0.25,
                micro_batches=cfg["slots"], warmup=True, async_scheduling=overlap,
            )  # fmt: skip
            run = run_pipeline(options)
            tokens = sum(r["num_output_tokens"] for r in run.requests)
            tpot = [r["tpot_s"] for r in run.requests if r["tpot_s"] is not None]
            runs[overlap].append({"tok_per_s": tokens / run.wall_s, "tpot_ms": 1e3 * statistics.mean(tpot),
                                  "overlapped_batches": run.stages[0].get("overlapped_batches"),
                                  "tokens": [r["token_ids"] for r in run.requests]})  # fmt: skip
            print(f"  async_scheduling={overlap}: {runs[overlap][-1]['tok_per_s']:.1f} tok/s", flush=True)
    same = all(a["tokens"] == b["tokens"] for a, b in zip(runs[False], runs[True], strict=True))
    rows = {}
    for overlap, name in ((False, "without"), (True, "with")):
        rows[name] = {
            key: statistics.median(r[key] for r in runs[overlap]) for key in ("tok_per_s", "tpot_ms")
        }
        rows[name]["runs"] = [{k: v for k, v in r.items() if k != "tokens"} for r in runs[overlap]]
    layers = [(st["layer_start"], st["layer_end"]) for st in json.loads(plan.read_text())["stages"]]
    print(f"\n2-stage plan {layers}, {cfg['requests']} requests of {cfg['prompt']} + {cfg['output']}, "
          f"{args.rounds} rounds")  # fmt: skip
    print("| async scheduling | tok/s | TPOT ms |\n|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['tok_per_s']:.1f} | {row['tpot_ms']:.1f} |")
    print(f"throughput with / without: {rows['with']['tok_per_s'] / rows['without']['tok_per_s']:.2f}x; "
          f"same tokens: {same}")  # fmt: skip
    return {"config": cfg, "layers": layers, "rows": rows, "same_tokens": same}


def table(rows: list[dict]) -> str:
    head = ("model", "running", "without ms", "with ms", "speedup", "same", "ahead")
    lines = [f"{head[0]:<8} " + " ".join(f"{h:>{max(len(h), 7)}}" for h in head[1:])]
    for r in rows:
        lines.append(
            f"{r['model']:<8} {r['running']:>7} {r['step_ms_without']:>10.3f} {r['step_ms_with']:>8.3f} "
            f"{r['speedup']:>7.3f} {str(r['same_tokens']):>5} {r['steps_ahead']:>6}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", default="1,16,64", help="counts of running requests")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per engine")
    parser.add_argument("--rounds", type=int, default=3, help="turns of the two engines")
    parser.add_argument("--models", default="tiny,smollm2", help="tiny, smollm2 or both")
    parser.add_argument("--model", help="the SmolLM2 checkpoint (default: `tessel example-model`'s)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU: CUDA graphs, no thread limit)")
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (float16 on a GPU, say)")
    parser.add_argument("--plan", action="store_true", help="the 2-stage plan instead (module docstring)")
    parser.add_argument("--plan-requests", type=int, default=8)
    parser.add_argument("--plan-output", type=int, default=64)
    _harness.add_record_options(parser, "async_scheduling")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print(_harness.machine_line())
    if args.plan:
        with tempfile.TemporaryDirectory(prefix="async-scheduling-plan-") as folder:
            result = plan_rounds(_harness.example_model(args.model), args, Path(folder))
        _harness.append_record(
            args.out, "async_scheduling", {"plan": result, "rounds": args.rounds}, args.label
        )
        return
    counts = [int(n) for n in args.running.split(",") if n]
    rows = []
    with tempfile.TemporaryDirectory(prefix="async-scheduling-") as folder:
        models = {}
        for name in args.models.split(","):
            if name == "tiny":
                models[name] = host_step.tiny_model(Path(folder))
            elif name == "smollm2":
                models[name] = _harness.example_model(args.model)
            else:
                parser.error(f"--models: {name!r} is neither tiny nor smollm2")
        for name, model in models.items():
            for running in counts:
                row = {
                    "model": name,
                    **measure(model, running, args.steps, args.rounds, args.device, args.dtype),
                }
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
    print(table(rows))
    spec = {
        "running": counts,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": 1,
        "device": args.device,
    }
    spec["dtype"] = args.dtype
    path = _harness.append_record(args.out, "async_scheduling", {"spec": spec, "rows": rows}, args.label)
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
