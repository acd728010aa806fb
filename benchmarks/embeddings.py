"""Sentence-embedding throughput on this CPU: tessel's `Embedder` against HF transformers (and
sentence-transformers' `encode` when it is importable; it is not a dev dependency), same threads.

    python benchmarks/embeddings.py [--sentences 256] [--threads N] [--batch-size 32] [--dtype D]

The model is all-MiniLM-L6-v2 from its PyPI wheel (`tessel.example_models.encoder`, cached
outside the repository); the sentences are the first N of the held-out KJV text
(benchmarks/data/kjv_evaluation.txt). The HF baseline does what sentence-transformers' `encode`
does: texts sorted by length, batches of `--batch-size` padded to their longest, `AutoModel`, then
the model's pooling (mean) and normalisation, in float32 (`--dtype bfloat16` runs tessel in bf16).
Each provider's time is the median of `--repeats` interleaved runs over all the sentences, as wall
time and as this process's CPU time (`time.process_time` around each call, all threads summed; on a
machine other jobs load, the CPU time at `--threads 1` is the figure to compare, since waiting for a
core does not count in it); the record also holds the largest difference and the smallest cosine
between tessel's vectors and HF's.
Prints the CPU (ISA) and appends a record to benchmarks/results/embeddings.jsonl.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import _harness

KJV = _harness.BENCHMARKS / "data" / "kjv_evaluation.txt"


def sentences(count: int, min_chars: int = 20, max_chars: int = 600) -> list[str]:
    """The first `count` sentences of the held-out KJV text (the rule tests/encoder_models.py uses)."""
    text = " ".join(line for line in KJV.read_text(encoding="utf-8").splitlines() if line.strip())
    pieces = [s.strip() for s in re.split(r"(?<=[.?!])\s+", text)]
    chosen = [s for s in pieces if min_chars <= len(s) <= max_chars and not s.startswith("Chapter")]
    if len(chosen) < count:
        raise SystemExit(f"only {len(chosen)} sentences in {KJV}")
    return chosen[:count]


def hf_encoder(path, batch_size: int, max_length: int):  # noqa: ANN001, ANN201
    """sentence-transformers' encode() done with transformers: length-sorted batches, mean pool, normalise."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path)).eval()

    def encode(texts: list[str]) -> torch.Tensor:
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out = torch.empty((len(texts), model.config.hidden_size))
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch = tokenizer([texts[i].strip() for i in chunk], padding=True, truncation=True,
                              max_length=max_length, return_tensors="pt")  # fmt: skip
            with torch.inference_mode():
                hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[chunk] = torch.nn.functional.normalize(pooled, dim=1)
        return out

    return encode


def sentence_transformers_encoder(path, batch_size: int):  # noqa: ANN001, ANN201
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    model = SentenceTransformer(str(path), device="cpu")
    return lambda texts: model.encode(texts, batch_size=batch_size, convert_to_tensor=True)


def _cpu_timed(fn, runs: list[float]):  # noqa: ANN001, ANN202
    """`fn`, also appending each call's process CPU time (all threads) to `runs`."""

    def run() -> object:
        begin = time.process_time()
        try:
            return fn()
        finally:
            runs.append(time.process_time() - begin)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", help="tessel's: float32, bfloat16 (HF: float32)")
    _harness.add_record_options(parser, "embeddings")
    args = parser.parse_args()

    import torch

    from tessel.example_models.encoder import example_encoder_dir
    from tessel.models.embedder import Embedder

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(_harness.machine_line())
    print(f"cpu flags: {' '.join(_harness.machine()['cpu'].get('flags', []))}; torch threads: {threads}")
    path = example_encoder_dir()
    texts = sentences(args.sentences)
    embedder = Embedder(path, batch_size=args.batch_size, dtype=args.dtype)
    providers = {
        "tessel": lambda: embedder.embed(texts),
        "hf_transformers": lambda: hf(texts),
    }
    hf = hf_encoder(path, args.batch_size, embedder.max_tokens)
    st = sentence_transformers_encoder(path, args.batch_size)
    if st is not None:
        providers["sentence_transformers"] = lambda: st(texts)
    ours, theirs = embedder.embed(texts), hf(texts)
    max_abs_diff = float((ours - theirs).abs().max())
    min_cosine = float(torch.nn.functional.cosine_similarity(ours, theirs).min())
    cpu_runs: dict[str, list[float]] = {name: [] for name in providers}
    wrapped = {name: _cpu_timed(fn, cpu_runs[name]) for name, fn in providers.items()}
    timed = _harness.time_calls(wrapped, warmup=1, repeats=args.repeats)
    cpu_runs = {name: runs[1:] for name, runs in cpu_runs.items()}  # the first call is the warm-up
    cpu_median = {name: statistics.median(runs) for name, runs in cpu_runs.items()}
    rates = {name: len(texts) / t.median_s for name, t in timed.items()}
    print(f"{'provider':<24}{'median s':>10}{'min s':>10}{'sentences/s':>14}{'median CPU s':>14}")
    for name, timing in timed.items():
        print(
            f"{name:<24}{timing.median_s:>10.3f}{timing.min_s:>10.3f}{rates[name]:>14.1f}{cpu_median[name]:>14.3f}"
        )
    ratios = {f"tessel_over_{name}": rates["tessel"] / rates[name] for name in rates if name != "tessel"}
    cpu_ratios = {f"tessel_over_{name}": cpu_median[name] / cpu_median["tessel"] for name in cpu_median}
    del cpu_ratios["tessel_over_tessel"]
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x wall, {cpu_ratios[name]:.2f}x process CPU time")
    versus = f"max |difference| {max_abs_diff:.2e}, min cosine {min_cosine:.7f}"
    print(f"tessel ({args.dtype}) vs hf (float32): {versus}")
    tokens = sum(len(row) for row in embedder.tokenize(texts))
    result = {
        "model": "all-MiniLM-L6-v2",
        "sentences": len(texts),
        "tokens": tokens,
        "threads": threads,
        "batch_size": args.batch_size,
        "median_s": {name: t.median_s for name, t in timed.items()},
        "runs_s": {name: list(t.runs_s) for name, t in timed.items()},
        "sentences_per_s": rates,
        "ratios": ratios,
        "cpu_median_s": cpu_median,
        "cpu_runs_s": cpu_runs,
        "cpu_ratios": cpu_ratios,
        "dtype": args.dtype,
        "max_abs_diff_vs_hf": max_abs_diff,
        "min_cosine_vs_hf": min_cosine,
        "sentence_transformers": st is not None,
    }
    _harness.append_record(args.out, "embeddings", result, args.label)


if __name__ == "__main__":
    main()
