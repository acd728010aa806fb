"""Where a decode step's time goes: wall-clock timers around the engine's modules.

    python benchmarks/decode_profile.py [--model DIR] [--concurrent 1] [--steps 20] [--threads 1] \
        [--lm-head int8] [--out PATH.jsonl]

Loads the model (default SmolLM2-135M-Instruct; a quantised checkpoint directory works too), starts
`--concurrent` requests of 64 prompt tokens, runs their prefill and 4 decode steps, then times
`--steps` decode steps with `time.perf_counter` around each linear (per kind), the attention
(cache write + paged decode), RMSNorm, RoPE, SiLU-and-mul, the LM head, input preparation,
sampling and the scheduler. "other in run" is the model runner's time outside those (Python glue,
views, splits, module calls); "outside run" is the engine's own (stop rules, detokenising).
Timers add a few microseconds per call, so the parts sum to slightly more than an untimed step.
The timers wrap the eager modules, so this mode runs the engine with `enforce_eager=True` (a
one-sequence step would otherwise run as compiled graphs, `tessel.engine.cpu_graph`).

`--torch-profiler` times the same steps without the timers, under `torch.profiler`, and prints the
operators with the most self CPU time per step instead (op, ms per step, calls per step), with
the engine's defaults (compiled one-sequence steps included) unless `--enforce-eager` is given.
Each run appends a record to benchmarks/results/decode_profile.jsonl.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import _harness
import torch

EVAL = Path(__file__).parent / "data" / "kjv_evaluation.txt"
PARTS = ("attention", "rmsnorm", "silu_and_mul", "rope", "embed", "lm_head", "prepare inputs", "sample")


class Timers:
    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()

    def wrap(self, obj, attr: str, name: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args, **kwargs):  # hundreds of calls per step: two perf_counter reads, no more
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            return out

        object.__setattr__(obj, attr, timed)  # an instance attribute shadows the bound method


def instrument(llm, timers: Timers) -> None:
    model = llm.model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module, name in ((attn.qkv_proj, "qkv"), (attn.o_proj, "o"), (mlp.gate_up_proj, "gate_up"),
                             (mlp.down_proj, "down")):  # fmt: skip
            timers.wrap(module, "forward", f"linear {name}")
        timers.wrap(attn.attn, "forward", "attention")
        timers.wrap(layer.input_layernorm, "forward", "rmsnorm")
        timers.wrap(layer.post_attention_layernorm, "forward", "rmsnorm")
        timers.wrap(mlp.act, "forward", "silu_and_mul")
    timers.wrap(model.model.norm, "forward", "rmsnorm")
    timers.wrap(model.model.rotary, "forward", "rope")
    timers.wrap(model.model.rotary, "rotate_qk", "rope")  # LlamaAttention calls this one
    timers.wrap(model.model.embed_tokens, "forward", "embed")
    timers.wrap(model, "compute_logits", "lm_head")
    timers.wrap(llm.runner, "prepare", "prepare inputs")
    timers.wrap(llm.runner, "sample", "sample")
    timers.wrap(llm.runner, "run", "run")
    timers.wrap(llm.scheduler, "schedule", "schedule")


def profile(model_dir: str, concurrent: int, steps: int, lm_head: str = "float") -> dict[str, float]:
    """-> milliseconds per decode step, by part ("step": the whole step)."""
    from tessel import LLM, SamplingParams

    llm = LLM(
        model_dir,
        max_model_len=64 + steps + 16,
        max_num_seqs=max(concurrent, 1),
        lm_head=lm_head,
        enforce_eager=True,  # the timers wrap the eager modules
    )
    ids = llm.tokenizer(EVAL.read_text(encoding="utf-8"))["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(concurrent):
        llm.add_request(f"r{i}", ids[i * 64 : (i + 1) * 64], params)
    timers = Timers()
    instrument(llm, timers)
    for _ in range(5 if concurrent == 1 else 8):  # prefill(s), warm-up decode steps (the GEMV compiles)
        llm.step()
    timers.seconds.clear()
    with _harness.stopwatch() as whole:
        for _ in range(steps):
            llm.step()
    ms = {name: s / steps * 1e3 for name, s in timers.seconds.items()}
    ms["step"] = whole.wall_s / steps * 1e3
    ms["step CPU time"] = whole.cpu_s / steps * 1e3
    ms["linear (decoder layers)"] = sum(v for k, v in ms.items() if k.startswith("linear "))
    ms["other in run"] = ms["run"] - ms["linear (decoder layers)"] - sum(ms.get(p, 0.0) for p in PARTS)
    ms["outside run"] = ms["step"] - ms["run"] - ms.get("schedule", 0.0)
    return ms


def op_profile(
    model_dir: str, concurrent: int, steps: int, lm_head: str, top: int, enforce_eager: bool = False
) -> dict:
    """-> {"step": untimed ms per step, "ops": [(op, self CPU ms per step, calls per step)]}."""
    from torch.profiler import ProfilerActivity, profile

    from tessel import LLM, SamplingParams

    llm = LLM(
        model_dir,
        max_model_len=64 + 2 * steps + 16,
        max_num_seqs=max(concurrent, 1),
        lm_head=lm_head,
        enforce_eager=enforce_eager,
    )
    ids = llm.tokenizer(EVAL.read_text(encoding="utf-8"))["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)
    for i in range(concurrent):
        llm.add_request(f"r{i}", ids[i * 64 : (i + 1) * 64], params)
    for _ in range(5 if concurrent == 1 else 8):
        llm.step()
    with _harness.stopwatch() as whole:
        for _ in range(steps):
            llm.step()
    step_ms = whole.wall_s / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    ops = [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in events]
    return {"step": step_ms, "ops": ops}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct from the cache)")
    parser.add_argument("--concurrent", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lm-head", default="float", help="float or int8 (the engine's lm_head option)")
    parser.add_argument("--torch-profiler", type=int, default=0, metavar="TOP",
                        help="print the TOP operators by self CPU time (torch.profiler) instead")  # fmt: skip
    parser.add_argument("--enforce-eager", action="store_true",
                        help="with --torch-profiler: no compiled one-sequence decode step")  # fmt: skip
    _harness.add_record_options(parser, "decode_profile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.model = str(_harness.example_model(args.model))
    settings = {key: getattr(args, key) for key in ("concurrent", "steps", "threads", "lm_head")}
    if args.torch_profiler:
        result = op_profile(
            args.model, args.concurrent, args.steps, args.lm_head, args.torch_profiler, args.enforce_eager
        )
        print(f"{Path(args.model).name}, lm_head {args.lm_head}, {args.concurrent} sequence(s), "
              f"{args.threads} thread(s): {result['step']:.1f} ms per decode step (untimed)")  # fmt: skip
        print("\n| operator | self CPU ms per step | calls per step |\n|---|---|---|")
        for name, ms, calls in result["ops"]:
            print(f"| {name} | {ms:.2f} | {calls:g} |")
        settings |= {"torch_profiler": args.torch_profiler, "enforce_eager": args.enforce_eager}
        record = {"model": Path(args.model).name, **settings, "ops_ms_per_step": result}
        _harness.append_record(args.out, "decode_profile", record, args.label)
        return
    ms = profile(args.model, args.concurrent, args.steps, args.lm_head)
    step = ms["step"]
    print(f"{Path(args.model).name}, lm_head {args.lm_head}, {args.concurrent} sequence(s), "
          f"{args.threads} thread(s): {step:.1f} ms per decode step "
          f"({ms['step CPU time']:.1f} ms CPU time)")  # fmt: skip
    print("\n| part | ms per step | share |\n|---|---|---|")
    shown = [k for k in ms if k not in ("step", "run", "step CPU time")]
    for name in sorted(shown, key=lambda k: -ms[k]):
        print(f"| {name} | {ms[name]:.2f} | {100 * ms[name] / step:.1f}% |")
    record = {"model": Path(args.model).name, **settings, "ms_per_step": ms}
    _harness.append_record(args.out, "decode_profile", record, args.label)


if __name__ == "__main__":
    main()
