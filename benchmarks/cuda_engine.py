"""tessel's engine on a CUDA GPU against HF transformers' `generate` on the same GPU; print a table,
write JSON.

    python benchmarks/cuda_engine.py [--shape smollm2|llama-1b] [--quick] [--rows ...] \
        [--out benchmarks/results/cuda_engine.jsonl] [--label NAME]

The model has SmolLM2-135M's shapes (hidden 576, FFN 1536, 30 layers, 9 heads / 3 KV heads, vocab
49152, tied embeddings), or with `--shape llama-1b` Llama-3.2-1B's (hidden 2048, FFN 8192, 16
layers, 32 heads / 8 KV heads, vocab 128256, tied embeddings: 1.24 B parameters, where the
weights' bytes start to matter), with random weights: the GPU machine has no network and no room
for real checkpoints, and decode speed does not depend on the weights' values. Quantised copies are
written by `tessel quantize` (round to nearest, W8A8 per-token dynamic and W8A16 per channel) with
the repo's calibration text.

Workloads (EOS ignored, greedy):
- one stream: a 128-token prompt, 128 new tokens;
- 32 requests at once: 32 prompts of 128 tokens, 128 new tokens each. HF takes them as one batch
  (equal lengths, so no padding), tessel through its scheduler (continuous batching).
Each phase: one warm-up run, then the best of `--repeats` (wall clock, `torch.cuda.synchronize`
around it: `_harness.time_call(..., clock="cuda-wall")`). tok/s counts the new tokens. `vs HF` =
tessel tok/s / HF float16 tok/s of that workload. tessel replays its decode steps as CUDA graphs
(`tessel.engine.cuda_graph`), captured by `LLM.warm_up()` before the timing (its seconds are
recorded); the `eager` rows launch every kernel from Python. Each run appends a record to
benchmarks/results/cuda_engine.jsonl; the figures so far are kept beside it
(`cuda_engine.jsonl.partial.tmp`) after every row, should a later one hang.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

import _harness
import torch

SHAPES = {  # name -> (the HF config's sizes, KV heads)
    "smollm2": (
        {
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "max_position_embeddings": 2048,
            "rope_theta": 100000.0,
            "rms_norm_eps": 1e-5,
        },
        3,
    ),
    "llama-1b": (
        {
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "max_position_embeddings": 2048,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
        },
        8,
    ),
}
PROMPT_TOKENS = 128
NEW_TOKENS = 128
BATCH = 32
# (row name, checkpoint, tessel dtype, LM head mode, eager: no CUDA graphs)
TESSEL_ROWS = [
    ("tessel float16", "fp", torch.float16, "float", False),
    ("tessel float16 eager", "fp", torch.float16, "float", True),
    ("tessel bfloat16", "fp", torch.bfloat16, "float", False),
    ("tessel W8A8 (float16 acts)", "w8a8", torch.float16, "float", False),
    ("tessel W8A8 + int8 head", "w8a8", torch.float16, "int8", False),
    ("tessel W8A8 eager", "w8a8", torch.float16, "float", True),
    ("tessel W8A16 (float16 acts)", "w8a16", torch.float16, "float", False),
]


def build_checkpoints(root: Path, shape_name: str, quick: bool) -> dict[str, Path]:
    from typer.testing import CliRunner

    from tessel.cli import app

    tiny_models = _harness.tests_module("tiny_models")
    sizes, kv_heads = SHAPES[shape_name]
    shape = dict(sizes)
    if quick:
        shape["num_hidden_layers"] = 4
    fp = tiny_models.make_tiny_checkpoint(
        root / "fp", "llama", tie_word_embeddings=True, num_kv_heads=kv_heads, seed=0, **shape
    )
    calib = root / "calib.txt"
    calib.write_text((tiny_models.CORPUS + "\n") * 8, encoding="utf-8")
    paths = {"fp": fp}
    for scheme in ("w8a8", "w8a16"):
        out = root / scheme
        args = ["quantize", str(fp), "--scheme", scheme, "--out", str(out), "--calib", str(calib)]
        result = CliRunner().invoke(app, [*args, "--calib-samples", "2", "--seq-len", "32"])
        if result.exit_code != 0:
            raise RuntimeError(f"tessel quantize --scheme {scheme} failed: {result.output}")
        paths[scheme] = out
    return paths


def prompts(count: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab, (count, PROMPT_TOKENS), generator=g).tolist()


def best_seconds(run, repeats: int) -> float:
    """After one warm-up run (Triton's JIT and autotuning, cuBLAS handles), the best of `repeats`."""
    return _harness.time_call(run, warmup=1, repeats=repeats, clock="cuda-wall").min_s


def tessel_row(
    path: Path, dtype: torch.dtype, lm_head: str, eager: bool, batch: list[list[int]], repeats: int
) -> dict:
    from tessel import LLM, SamplingParams

    torch.cuda.reset_peak_memory_stats()
    llm = LLM(
        path,
        device="cuda",
        dtype=dtype,
        lm_head=lm_head,
        max_model_len=512,
        max_num_seqs=BATCH,
        enforce_eager=eager,
    )
    with _harness.stopwatch() as capture:
        llm.warm_up()  # every bucket's CUDA graph, as `tessel serve` does before it listens
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def run(prompts_: list[list[int]]) -> None:
        outputs = llm.generate(prompts_, params, use_progress=False)
        assert all(len(o.token_ids) == NEW_TOKENS for o in outputs)

    one = best_seconds(lambda: run(batch[:1]), repeats)
    many = best_seconds(lambda: run(batch), repeats)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    tok_s = {"one_stream_tok_s": NEW_TOKENS / one, "batch_tok_s": BATCH * NEW_TOKENS / many}
    graphs = llm.runner.cuda_graphs
    replays = graphs and graphs.replays
    return {**tok_s, "peak_gib": peak_gib, "warm_up_s": capture.wall_s, "graph_replays": replays}


def hf_row(path: Path, batch: list[list[int]], repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16).to("cuda").eval()

    def run(prompts_: list[list[int]]) -> None:
        ids = torch.tensor(prompts_, device="cuda")
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        assert out.shape[1] == PROMPT_TOKENS + NEW_TOKENS

    one = best_seconds(lambda: run(batch[:1]), repeats)
    many = best_seconds(lambda: run(batch), repeats)
    return {"one_stream_tok_s": NEW_TOKENS / one, "batch_tok_s": BATCH * NEW_TOKENS / many}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--quick", action="store_true", help="4 layers, 1 repeat: a smoke run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default="", help="comma-separated tessel row names to run (default: all)")
    _harness.add_record_options(parser, "cuda_engine")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/cuda_engine.py needs a CUDA GPU")
    repeats = 1 if args.quick else args.repeats
    wanted = [r for r in args.rows.split(",") if r]
    rows = [r for r in TESSEL_ROWS if not wanted or r[0] in wanted]
    sizes, kv_heads = SHAPES[args.shape]
    record = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "model": {"shape": args.shape, **sizes, "num_key_value_heads": kv_heads, "quick": args.quick},
        "workload": {"prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "batch": BATCH},
        "repeats": repeats,
        "results": {},
    }
    results = record["results"]
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_checkpoints(Path(tmp), args.shape, args.quick)
        batch = prompts(BATCH, sizes["vocab_size"])
        results["HF transformers float16"] = hf_row(paths["fp"], batch, repeats)
        print(f"HF float16: {results['HF transformers float16']}", flush=True)
        for name, checkpoint, dtype, lm_head, eager in rows:
            try:
                results[name] = tessel_row(paths[checkpoint], dtype, lm_head, eager, batch, repeats)
            except Exception as error:  # one failing row must not lose the others' figures
                results[name] = {"error": f"{type(error).__name__}: {error}"}
            torch.cuda.empty_cache()  # the row's engine is gone: give its memory back before the next
            print(f"{name}: {results[name]}", flush=True)
            _harness.save_partial(args.out, "cuda_engine", record, args.label)  # should a later one hang

    hf = results["HF transformers float16"]
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"host (eager rows launch from its CPU): {_harness.machine_line()}")
    print(f"{'row':<30} {'one stream tok/s':>17} {'vs HF':>6} {f'{BATCH} requests tok/s':>19} {'vs HF':>6}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<30} {r['error'][:80]}")
            continue
        one, many = r["one_stream_tok_s"], r["batch_tok_s"]
        r["one_stream_vs_hf"], r["batch_vs_hf"] = one / hf["one_stream_tok_s"], many / hf["batch_tok_s"]
        ratios = f"{one:>17.1f} {r['one_stream_vs_hf']:>5.2f}x {many:>19.1f} {r['batch_vs_hf']:>5.2f}x"
        print(f"{name:<30} {ratios}")
    _harness.append_record(args.out, "cuda_engine", record, args.label)


if __name__ == "__main__":
    main()
