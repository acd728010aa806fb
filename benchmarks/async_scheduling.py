"""Async scheduling against the engine without it (issue 47): decode step time and tokens, on the
tiny model whose forward is mostly Python (host_step.py's: 2 layers, hidden 64) and on SmolLM2-135M,
whose forward is mostly arithmetic, float32, one thread.

    python benchmarks/async_scheduling.py [--running 1,16,64] [--steps 40] [--rounds 3] \
        [--models tiny,smollm2] [--device cuda --dtype float16] [--out PATH.jsonl]

For each model and count of running requests (16 prompt tokens, greedy, `ignore_eos`, long enough
never to finish), an engine of each kind is built in turn for `--rounds` rounds; each runs 6 steps
untimed, then `--steps` steps, wall time each; a figure is the median step over its rounds' steps.
`speedup` = without / with. `same_tokens`: each request's tokens equal between the two engines in
every round. `steps_ahead`: the decode steps launched before the last one's tokens were applied.

What it shows on a CPU: whether the host's work, overlapped with a forward on a worker thread,
comes off the step. The forward holds the GIL for its Python and frees it in its kernels, so the
overlap pays only where the kernels are most of the forward and the host's work a visible share of
the step; a GPU's forward is kernels the host only launches (not measured here).
"""

from __future__ import annotations

import argparse
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
    _harness.add_record_options(parser, "async_scheduling")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print(_harness.machine_line())
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
