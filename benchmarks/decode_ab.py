"""A/B of one engine change, alternating it on and off every decode step of the same requests.

    python benchmarks/decode_ab.py [--model DIR] [--change batched-attention] [--concurrent 32] \
        [--prompt-len 64] [--steps 40] [--lm-head int8] [--threads 1] [--out PATH.jsonl]

A shared CPU's speed drifts by tens of percent over seconds, more than a small change gains, so
two whole runs one after the other cannot compare it. Here the change flips before every step of
one generation (`--concurrent` requests of `--prompt-len` tokens, after 12 warm-up steps: the
harness's interleaved timer with the two sides as its two callables), and each side gets the
median of its step times; `ratio` is the median over adjacent step pairs of
off / on (> 1: the change is faster). Changes:

- batched-attention: the CPU decode attention's batched form for short contexts
  (`tessel.kernels.paged_decode.batched_fits`), against the per-sequence loop;
  `--batched-max-tokens` / `--batched-max-mib` move its limits, to see where it stops winning.

Each run appends a record to benchmarks/results/decode_ab.jsonl, with the machine's features.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
from collections.abc import Callable
from pathlib import Path

import _harness
import torch

EVAL = Path(__file__).parent / "data" / "kjv_evaluation.txt"
WARM_UP_STEPS = 12  # the prefill, then decode steps on both sides (the compiles)


def batched_attention_switch() -> Callable[[bool], None]:
    module = importlib.import_module("tessel.kernels.paged_decode")
    fits = module.batched_fits

    def switch(on: bool) -> None:
        module.batched_fits = fits if on else (lambda *args: False)

    return switch


CHANGES = {"batched-attention": batched_attention_switch}


def step_times(
    llm, switch: Callable[[bool], None], concurrent: int, prompt_len: int, steps: int
) -> dict[bool, list[float]]:
    from tessel import SamplingParams

    ids = llm.tokenizer(EVAL.read_text(encoding="utf-8"))["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
    for i in range(concurrent):
        llm.add_request(f"ab{i}", ids[i * prompt_len : (i + 1) * prompt_len], params)

    def step(on: bool) -> Callable[[], None]:
        return lambda: (switch(on), llm.step())

    timed = _harness.time_calls(
        {"off": step(False), "on": step(True)}, warmup=WARM_UP_STEPS // 2, repeats=-(-steps // 2)
    )
    switch(True)
    while llm.has_unfinished_requests():
        llm.step()
    return {False: list(timed["off"].runs_s), True: list(timed["on"].runs_s)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct from the cache)")
    parser.add_argument("--change", choices=sorted(CHANGES), default="batched-attention")
    parser.add_argument("--concurrent", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lm-head", default="float", help="float or int8 (the engine's lm_head option)")
    parser.add_argument("--batched-max-tokens", type=int, help="the batched attention's context limit")
    parser.add_argument("--batched-max-mib", type=float, help="... and its padded K copy limit, MiB")
    parser.add_argument("--threads", type=int, default=1)
    _harness.add_record_options(parser, "decode_ab")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    paged_decode = importlib.import_module("tessel.kernels.paged_decode")
    if args.batched_max_tokens is not None:
        paged_decode.BATCHED_MAX_TOKENS = args.batched_max_tokens
    if args.batched_max_mib is not None:
        paged_decode.BATCHED_MAX_BYTES = int(args.batched_max_mib * 2**20)
    args.model = str(_harness.example_model(args.model))
    from tessel import LLM

    max_len = args.prompt_len + args.steps + 32
    llm = LLM(args.model, max_model_len=max_len, max_num_seqs=args.concurrent, lm_head=args.lm_head)
    times = step_times(llm, CHANGES[args.change](), args.concurrent, args.prompt_len, args.steps)
    off_ms, on_ms = (statistics.median(times[side]) * 1e3 for side in (False, True))
    ratio = statistics.median(a / b for a, b in zip(times[False], times[True], strict=False))
    print(_harness.machine_line())
    print(f"{Path(args.model).name}, lm_head {args.lm_head}, {args.concurrent} sequence(s), {args.change}: "
          f"off {off_ms:.2f} ms/step, on {on_ms:.2f} ms/step, off/on {ratio:.3f}")  # fmt: skip
    record = {
        "model": Path(args.model).name, "change": args.change, "concurrent": args.concurrent,
        "prompt_len": args.prompt_len, "lm_head": args.lm_head, "steps": args.steps,
        "threads": args.threads, "off_ms": off_ms, "on_ms": on_ms, "ratio_off_over_on": ratio,
        "batched_max_tokens": paged_decode.BATCHED_MAX_TOKENS,
        "batched_max_bytes": paged_decode.BATCHED_MAX_BYTES,
        "cpu_flags": _harness.machine()["cpu"]["flags"], "torch": torch.__version__,
    }  # fmt: skip
    _harness.append_record(args.out, "decode_ab", record, args.label)


if __name__ == "__main__":
    main()
