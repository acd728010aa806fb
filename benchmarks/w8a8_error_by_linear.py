"""Which linears carry a model's W8A8 error: fake-quantise one kind of linear at a time in the float
transformers model, its inputs (int8 per token) or its weights (int8 per output channel), round to
nearest, no smoothing, and print the perplexity on two windows of BOS + 511 evaluation tokens.

    python benchmarks/w8a8_error_by_linear.py [--model DIR]      (default: Gemma 3 270M from the cache)

A diagnostic (a few minutes on one thread): it prints, it writes no record.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import _harness
import torch

EVAL = Path(__file__).parent / "data" / "kjv_evaluation.txt"
KINDS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
WINDOWS, WINDOW_TOKENS = 2, 511


def fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """int8 symmetric per row (per token for inputs, per output channel for weights)."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(x / scale) * scale


@torch.no_grad()
def mean_nll(model, windows: list[list[int]]) -> float:
    total = 0.0
    for window in windows:
        logits = model(torch.tensor([window])).logits[0, :-1].double()
        total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:]), reduction="sum"))
    return total / sum(len(w) - 1 for w in windows)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/tessel/gemma-3-270m"))
    _harness.add_record_options(parser, "w8a8_error_by_linear")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids = tokenizer(EVAL.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    step = WINDOW_TOKENS
    windows = [[tokenizer.bos_token_id, *ids[i * step : (i + 1) * step]] for i in range(WINDOWS)]
    base = mean_nll(model, windows)
    print(f"float ppl {math.exp(base):.3f}", flush=True)
    result: dict = {"model": args.model, "float_ppl": math.exp(base), "rows": []}
    linears = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.")
    }
    for label, leaves in [*KINDS.items(), ("all", sum(KINDS.values(), ()))]:
        for mode in ("acts", "weights"):
            chosen = [m for n, m in linears.items() if n.rsplit(".", 1)[-1] in leaves]
            saved = [(m, m.weight.data.clone()) for m in chosen] if mode == "weights" else []
            for m, _ in saved:
                m.weight.data = fake_quant_rows(m.weight.data)
            hooks = (
                []
                if saved
                else [m.register_forward_pre_hook(lambda _m, a: (fake_quant_rows(a[0]),)) for m in chosen]
            )
            nll = mean_nll(model, windows)
            for m, weight in saved:
                m.weight.data = weight
            for hook in hooks:
                hook.remove()
            print(
                f"{label:8s} {mode:8s} ppl {math.exp(nll):.3f} ({100 * (math.exp(nll - base) - 1):+.2f}%)",
                flush=True,
            )
            result["rows"].append({"linears": label, "quantised": mode, "ppl": math.exp(nll)})
    _harness.append_record(args.out, "w8a8_error_by_linear", result, args.label)


if __name__ == "__main__":
    main()
