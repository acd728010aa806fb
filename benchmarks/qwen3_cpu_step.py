"""One stream of a Qwen3-shaped W8A8 model on the CPU: the eager step against the compiled graphs and
the native one-row step, which take Qwen3's q/k norms (issue 47).

    python benchmarks/qwen3_cpu_step.py [--layers 28] [--hidden 1024] [--intermediate 3072] \
        [--heads 16] [--kv-heads 8] [--head-dim 128] [--new-tokens 64] [--rounds 5] [--out PATH.jsonl]

No Qwen3 weights can be fetched here, so the model is Qwen3-0.6B's layers (the defaults: 28 layers,
hidden 1024, FFN 3072, 16 query and 8 kv heads of 128, q/k norms) with random weights, saved with
the example model's tokenizer (SmolLM2's 49,152 tokens: the vocabulary, and so the LM head, is that
one's, not Qwen3's 151,936), quantised W8A8 (round to nearest, dynamic activations, int8 LM head)
in a cache folder outside the repository. The speed of a step does not depend on the weights' values.

Three engines on the same checkpoint, one thread, rounds interleaved, 64 prompt tokens then
`--new-tokens` greedy tokens (EOS ignored), tok/s of the decode:

    eager            `enforce_eager=True`: each module called from Python, as every Qwen3 step ran
                     before the compiled step took q/k norms
    compiled graphs  the one-row step as inductor's graphs ($TESSEL_DECODE_ROW=off)
    native step      the one-row step as one C++ call (`tessel.engine.native_row`)

Ratios are the median over rounds of each engine against eager in the same round. The CPU's
features are printed and recorded beside the figures (a record in
benchmarks/results/qwen3_cpu_step.jsonl).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path

import _harness
import torch

import quant  # benchmarks/quant.py: the W8A8 checkpoint and the engine as it measures it

ENGINES = {
    "eager": ({}, True),
    "compiled graphs": ({"TESSEL_DECODE_ROW": "off"}, False),
    "native step": ({}, False),
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
SHAPE = ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim")


def random_qwen3(args: argparse.Namespace, root: Path) -> Path:
    """A random Qwen3 of the asked shape with the example model's tokenizer, written once under root."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = "-".join(str(getattr(args, name)) for name in SHAPE)
    path = root / f"qwen3-random-{shape}"
    if (path / "config.json").exists():
        return path
    example = _harness.example_model()
    vocab = len(_tokenizer(example))
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    staging = root / f".{path.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)  # our own leftover from an interrupted run
    Qwen3ForCausalLM(config).save_pretrained(staging)
    for name in TOKENIZER_FILES:
        if (example / name).exists():
            shutil.copy(example / name, staging / name)
    staging.rename(path)
    return path


def _tokenizer(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def engine_rounds(checkpoint: Path, args: argparse.Namespace) -> dict:
    from tessel import SamplingParams

    max_len = 64 + args.new_tokens + 8
    engines = {
        name: quant._speed_llm(checkpoint, forced, "int8", eager, max_len)
        for name, (forced, eager) in ENGINES.items()
    }
    graph = engines["native step"].runner.cpu_graph
    if graph is None or graph.native_row is None:
        raise SystemExit("the native one-row step is not taken here (no compiler, or no W8A8 int8 GEMV)")
    if engines["compiled graphs"].runner.cpu_graph is None:
        raise SystemExit("the compiled one-row step is not taken here")
    text = quant.EVAL.read_text(encoding="utf-8")
    prompt = engines["eager"].tokenizer(text)["input_ids"][:64]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)

    def run(llm) -> float:
        out = llm.generate([prompt], params, use_progress=False)[0]
        return (args.new_tokens - 1) / (out.metrics.finish_time - out.metrics.first_token_time)

    tok_s: dict[str, list[float]] = {name: [] for name in engines}
    order = list(engines)
    for r in range(args.rounds + 1):  # round 0 warms up (compiles the graphs)
        for name in order[r % len(order) :] + order[: r % len(order)]:
            value = run(engines[name])
            if r:
                tok_s[name].append(value)
    rows = {}
    print(f"\none stream, {args.new_tokens} tokens after 64, {args.rounds} rounds (medians)")
    print("| engine | tok/s | vs eager |")
    print("|---|---|---|")
    for name, values in tok_s.items():
        ratio = statistics.median(v / e for v, e in zip(values, tok_s["eager"], strict=True))
        rows[name] = {"tok_per_s": statistics.median(values), "runs": values, "vs_eager": ratio}
        print(f"| {name} | {rows[name]['tok_per_s']:.1f} | {ratio:.2f}x |")
    over_graphs = statistics.median(
        a / b for a, b in zip(tok_s["native step"], tok_s["compiled graphs"], strict=True)
    )
    print(f"native step over the compiled graphs, same rounds: {over_graphs:.2f}x")
    paths = quant._quantized_paths(engines["eager"])
    return {"rows": rows, "native_over_graphs": over_graphs, "paths": paths}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--cache", help="folder for the random checkpoint and its W8A8 copy (default: tessel's cache)"
    )
    _harness.add_record_options(parser, "qwen3_cpu_step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(_harness.machine_line())
    from tessel.kernels.autotune import cache_dir

    root = Path(args.cache) if args.cache else cache_dir() / "benchmarks"
    root.mkdir(parents=True, exist_ok=True)
    model = random_qwen3(args, root)
    checkpoint = quant._quantize(model, "w8a8 rtn", root / f"{model.name}-w8a8", 16, 512)
    shape = {name: getattr(args, name) for name in SHAPE}
    result = {"shape": shape, "vocab": len(_tokenizer(model)), "new_tokens": args.new_tokens,
              "rounds": args.rounds, "engines": engine_rounds(checkpoint, args)}  # fmt: skip
    _harness.append_record(args.out, "qwen3_cpu_step", result, args.label)


if __name__ == "__main__":
    main()
