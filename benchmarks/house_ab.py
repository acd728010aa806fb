"""Speed before and after a change of the code's house, in one run: the one-process engine and a
2-stage CPU pipeline, on the same model, the two source trees taking turns.

    python benchmarks/house_ab.py [--before REV] [--model DIR] [--rounds 3] [--requests 8] \
        [--prompt 128] [--output 32] [--out PATH.jsonl]

`--before` is a git revision (default: the commit before issue 43's executors); its `src/` is
exported to a temporary folder with `git archive`, and each measurement runs in a fresh Python
process with `PYTHONPATH` at one tree or the other (`after` is this checkout's `src/`). A round
measures both trees on both workloads, in alternating order (before first in odd rounds), so the
machine's drift falls on both sides alike:

- engine: `LLM(model).generate` of `--requests` prompts of `--prompt` random tokens, `--output`
  tokens each, greedy (one warm-up generate first); output tokens per second of the timed one;
- pipeline: `run_pipeline` (what `tessel launch` runs) of the same requests on a 2-stage plan that
  splits the layers in half, one thread per stage; output tokens per second over stage 0's wall.

Printed: each side's median tokens per second and the ratio after / before per workload (the
median of the rounds' ratios). Each run appends one record to benchmarks/results/house_ab.jsonl,
with the machine's features.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import _harness

BEFORE_REV = "351bdf7"  # main before issue 43's executors (the engine subclass chain)
ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from pipeline_plans import write_plan  # tests/ is on PYTHONPATH
from tessel import LLM, SamplingParams
from tessel.pipeline.run import RunOptions, run_pipeline

model, workload, n, prompt, output, work = {model!r}, {workload!r}, {n}, {prompt}, {output}, Path({work!r})
generator = torch.Generator().manual_seed(0)
vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
prompts = [torch.randint(4, vocab, (prompt,), generator=generator).tolist() for _ in range(n)]
params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
if workload == "engine":
    llm = LLM(model, max_model_len=prompt + output + 16)
    llm.generate(prompts[:2], params, use_progress=False)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_progress=False)
    wall = time.perf_counter() - started
    tokens = sum(o.num_output_tokens for o in outs)
else:
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    plan = write_plan(work / "plan.json", Path(model), [(0, layers // 2), (layers // 2, layers)])
    requests = work / "requests.jsonl"
    requests.write_text("".join(json.dumps({{"prompt": p}}) + "\n" for p in prompts))
    run = run_pipeline(RunOptions(plan, Path(model), prompts_file=requests, max_tokens=output,
                                  ignore_eos=True, max_model_len=prompt + output + 16, run_dir=work / "run",
                                  warmup=True))
    wall = run.wall_s
    tokens = sum(r["num_output_tokens"] for r in run.requests)
print(json.dumps({{"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens}}))
"""


def export_src(rev: str, into: Path) -> Path:
    """`rev`'s src/ tree under `into` (git archive), -> its src folder."""
    data = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(into, filter="data")
    return into / "src"


def measure(src: Path, workload: str, args: argparse.Namespace, model: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="house-ab-") as work:
        code = CHILD.format(
            model=str(model), workload=workload, n=args.requests,
            prompt=args.prompt, output=args.output, work=work,
        )  # fmt: skip
        path = os.pathsep.join([str(src), str(ROOT / "tests")])
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{workload} on {src} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    model = _harness.example_model(args.model)
    with tempfile.TemporaryDirectory(prefix="house-before-") as folder:
        trees = {"before": export_src(args.before, Path(folder)), "after": ROOT / "src"}
        rounds = []
        for index in range(args.rounds):
            order = ("before", "after") if index % 2 == 0 else ("after", "before")
            measured = {
                workload: {side: measure(trees[side], workload, args, model) for side in order}
                for workload in ("engine", "pipeline")
            }
            rounds.append(measured)
            print(f"round {index + 1}: " + ", ".join(
                f"{w} before {m['before']['tok_s']:.1f} after {m['after']['tok_s']:.1f} tok/s"
                for w, m in measured.items()
            ), flush=True)  # fmt: skip
    summary = {}
    for workload in ("engine", "pipeline"):
        before = [r[workload]["before"]["tok_s"] for r in rounds]
        after = [r[workload]["after"]["tok_s"] for r in rounds]
        ratios = [a / b for a, b in zip(after, before, strict=True)]
        summary[workload] = {
            "before_tok_s": statistics.median(before),
            "after_tok_s": statistics.median(after),
            "ratio": statistics.median(ratios),
            "ratios": ratios,
        }
    return {"before": args.before, "model": str(model), "requests": args.requests, "prompt": args.prompt,
            "output": args.output, "rounds": rounds, "summary": summary}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=BEFORE_REV, help="git revision of the 'before' tree")
    parser.add_argument("--model", help="model directory (default: SmolLM2, `tessel example-model`)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=32)
    _harness.add_record_options(parser, "house_ab")
    args = parser.parse_args()
    print(_harness.machine_line(), flush=True)
    result = run(args)
    print(f"{'workload':<10} {'before tok/s':>13} {'after tok/s':>12} {'after/before':>13}")
    for workload, s in result["summary"].items():
        print(f"{workload:<10} {s['before_tok_s']:>13.1f} {s['after_tok_s']:>12.1f} {s['ratio']:>13.3f}")
    _harness.append_record(args.out, "house_ab", result, args.label)


if __name__ == "__main__":
    main()
