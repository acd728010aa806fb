"""An llm-compressor-format W8A8 checkpoint of SmolLM2 on each CPU int8 path: greedy tokens against
transformers (issue 47: "llm-compressor W8A8 checkpoints give transformers' greedy tokens on both"
AVX2 and AVX-512 machines).

    python benchmarks/w8a8_semantics.py [--prompts 6] [--new-tokens 32] [--out PATH.jsonl]

The checkpoint is written as llm-compressor's save path writes it, through compressed-tensors'
`ModelCompressor` (the tests' `write_with_model_compressor`: per-channel int8 weights from min/max,
the full range, -128 included; 8-bit per-token dynamic activations; the LM head float). The oracle is
transformers + compressed-tensors de-quantising the weights, each linear's input fake-quantised per
token (`tests/ct_oracle.hf_quantized`), decoding greedily. tessel decodes the same prompts (the first
64-token slices of the evaluation text) on each path, the path forced and, for the AVX2 rows, the
CPU's flags seen as an AVX2 machine's (what decides fbgemm's activation bits):

- `fp16codes`, AVX2 flags: AVX2's default for full-range weights (the codes through fbgemm's fp16 GEMM);
- `fbgemm`, AVX2 flags: the opt-in 7-bit activation codes (AVX2's int16 pair sums would saturate at 8);
- `fbgemm`, this CPU's flags (VNNI: 8-bit codes, the default there), `int_mm`, `dequant`.

Each row: the prompts whose tokens all equal transformers', the mean count of leading tokens that
do, and the perplexity over `--ppl-windows` 512-token windows of the evaluation text against
transformers'. Two rows hold transformers to itself: at 1 thread against 2, and computing in float64
against float32 (the same function with less rounding): a min/max W8A8 checkpoint rounds large
activations to steps of max|x| / 127, so a float32 rounding difference that moves one code moves the
rest of the decode; where float64 parts from float32, float32 does not settle the tokens, and no
engine with another summation order can promise them. Its perplexity is the checkpoint's measure.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import _harness

import quant as bench_quant  # benchmarks/quant.py: the evaluation text, tessel's perplexity

AVX2_FLAGS = frozenset({"avx", "avx2", "fma", "f16c"})
CASES = (  # (row, forced path, flags seen: None for this CPU's)
    ("fp16codes, AVX2 flags (AVX2 default)", "fp16codes", AVX2_FLAGS),
    ("fbgemm 7-bit activations, AVX2 flags (opt-in)", "fbgemm", AVX2_FLAGS),
    ("fbgemm, this CPU (VNNI default)", "fbgemm", None),
    ("int_mm", "int_mm", None),
    ("dequant", "dequant", None),
)


def prompts_of(model: Path, count: int, length: int = 64) -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model))(bench_quant.EVAL.read_text(encoding="utf-8"))["input_ids"]
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def hf_tokens(checkpoint: Path, prompts: list[list[int]], new_tokens: int, float64: bool = False) -> list:
    """transformers' greedy tokens; `float64`: the same model computing in float64 (the same function
    with less rounding: where its tokens part from float32's, float32 does not settle them)."""
    import torch

    oracle = _harness.tests_module("ct_oracle")
    model = oracle.hf_quantized(checkpoint)
    if float64:
        model = model.double()
    found = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens
            )
            found.append(out[0, len(prompt) :].tolist())
    return found


def hf_perplexity(checkpoint: Path, windows: list[list[int]], float64: bool = False) -> float:
    import torch

    model = _harness.tests_module("ct_oracle").hf_quantized(checkpoint)
    if float64:
        model = model.double()
    nll, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            logits = model(torch.tensor([window])).logits[0, :-1].double()
            nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:]), reduction="sum"))
            count += len(window) - 1
    return math.exp(nll / count)


def tessel_run(checkpoint: Path, prompts, new_tokens: int, path: str, flags, ppl_tokens: int) -> tuple:
    """(tokens per prompt, the paths the W8A8 layers took, perplexity over the first `ppl_tokens`
    tokens of the evaluation text in 512-token windows: `quant.perplexity`), `path` forced and
    `flags` seen."""
    import os

    from tessel import LLM, SamplingParams
    from tessel.kernels import cpu_features
    from tessel.layers.linear import w8a8

    real_flags = cpu_features.cpu_flags
    os.environ[cpu_features.ENV_OVERRIDE] = path
    if flags is not None:
        cpu_features.cpu_flags = lambda: flags
    try:
        llm = LLM(str(checkpoint), max_model_len=64 + new_tokens + 8, enforce_eager=True)
        taken = sorted({m.path for m in llm.model.modules() if isinstance(m, w8a8.W8A8Linear)})
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_progress=False)
        llm.shutdown()
        ppl = bench_quant.perplexity(checkpoint, 512, ppl_tokens)["ppl"]
    finally:
        cpu_features.cpu_flags = real_flags
        del os.environ[cpu_features.ENV_OVERRIDE]
    return [list(o.token_ids) for o in outputs], taken, ppl


def compare(got: list[list[int]], expected: list[list[int]]) -> dict:
    """Prompts whose tokens all agree, and the mean count of leading tokens that agree."""
    pairs = list(zip(got, expected, strict=True))
    leading = [
        next((i for i, (a, b) in enumerate(zip(g, e, strict=True)) if a != b), len(e)) for g, e in pairs
    ]
    return {"prompts_equal": sum(g == e for g, e in pairs), "mean_leading_equal": sum(leading) / len(leading)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="SmolLM2 checkpoint (default: `tessel example-model`'s)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--ppl-windows", type=int, default=4, help="512-token windows of the evaluation text")
    _harness.add_record_options(parser, "w8a8_semantics")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    print(_harness.machine_line())
    model = _harness.example_model(args.model)
    oracle = _harness.tests_module("ct_oracle")
    rows = []

    def show(row: dict) -> None:
        rows.append(row)
        print(f"{row['row']:<48} {row['prompts_equal']}/{args.prompts} prompts equal, "
              f"{row['mean_leading_equal']:.1f} leading tokens equal on average; perplexity {row['ppl']:.3f}"
              f" ({row['ppl_vs_transformers']:+.2%})", flush=True)  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="w8a8-semantics-") as folder:
        checkpoint = oracle.write_with_model_compressor(model, Path(folder) / "w8a8", "w8a8")
        prompts = prompts_of(model, args.prompts)
        windows = prompts_of(model, args.ppl_windows, 512)
        expected = hf_tokens(checkpoint, prompts, args.new_tokens)
        hf_ppl = hf_perplexity(checkpoint, windows)
        torch.set_num_threads(1)  # transformers against itself: another thread count, another float order
        itself = compare(hf_tokens(checkpoint, prompts, args.new_tokens), expected)
        show(
            {"row": "transformers, 1 thread (against 2)", "ppl": hf_ppl, "ppl_vs_transformers": 0.0} | itself
        )
        torch.set_num_threads(2)
        wider = compare(hf_tokens(checkpoint, prompts, args.new_tokens, float64=True), expected)
        wide_ppl = hf_perplexity(checkpoint, windows, float64=True)
        wide = {"row": "transformers in float64 (against float32)", "ppl": wide_ppl}
        show(wide | {"ppl_vs_transformers": wide_ppl / hf_ppl - 1} | wider)
        for name, path, flags in CASES:
            got, taken, ppl = tessel_run(
                checkpoint, prompts, args.new_tokens, path, flags, 512 * args.ppl_windows
            )
            show(
                {"row": name, "paths": taken, "ppl": ppl, "ppl_vs_transformers": ppl / hf_ppl - 1}
                | compare(got, expected)
            )
    spec = {
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "prompt_tokens": 64,
        "ppl_windows": args.ppl_windows,
    }
    _harness.append_record(args.out, "w8a8_semantics", {"spec": spec, "rows": rows}, args.label)


if __name__ == "__main__":
    main()
