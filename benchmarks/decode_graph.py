"""The compiled CPU decode step's pieces against their eager forms, and what compiling costs.

    python benchmarks/decode_graph.py [--threads 1] [--contexts 128,512,2048] \
        [--model DIR [--rows 1] [--ppl-windows 6]] [--out PATH.jsonl]

1. Attention of one query row (SmolLM2's heads: 9 query, 3 kv, head_dim 64; block size 16) over a
   paged cache: the eager engine's `paged_decode_attention` against the compiled attention graph
   (`tessel.engine.cpu_graph.attention_graph`), microseconds per call.
2. A W8A8 one-row linear (1 x 3072 x 576, SmolLM2's gate/up) compiled with its codes stored (a graph
   output, as the layers' one-row forms do, `tessel.layers.linear.forms`) and inlined (recomputed per
   output channel).
3. With `--model` (a quantised checkpoint; default: none): the first decode steps of a fresh engine
   with an empty inductor cache (compiling) against later ones, `--rows` sequences at once (the
   graph of their bucket of rows; more than one row only where the path splits a linear, e.g.
   TESSEL_INT8_PATH=fbgemm or fp16codes: eager otherwise).
4. With `--model` and `--ppl-windows N`: the held-out text's perplexity over N windows of 256
   tokens, token by token through the compiled decode step and through the eager one, each against
   the prefill's (W8A8's near-tie roundings make decode runs drift; this shows how far, each way).

The machine's features are printed and recorded beside the figures (a record appended to
benchmarks/results/decode_graph.jsonl). Ratios within one run are comparable.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import _harness

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def _time_us(fn, repeats: int = 7, calls: int = 200) -> float:
    """Median over `repeats` of the mean microseconds of `calls` calls (after one such untimed run)."""
    return _harness.time_call(fn, warmup=1, repeats=repeats, calls=calls).median_s * 1e6


def attention_rows(contexts: list[int]) -> list[dict]:
    import torch

    from tessel.engine.cpu_graph import attention_graph, bucket_blocks
    from tessel.kernels import cpu_compile
    from tessel.kernels.paged_decode import paged_decode_attention

    scale = HEAD_DIM**-0.5
    num_blocks = max(contexts) // BLOCK_SIZE * 2 + 8
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    fn = attention_graph(HEADS, KV_HEADS, HEAD_DIM, scale)
    rows = []
    for context in contexts:
        used = -(-context // BLOCK_SIZE)
        blocks = torch.randperm(num_blocks)[:used]
        table = torch.zeros(bucket_blocks(used, BLOCK_SIZE), dtype=torch.int64)
        table[:used] = blocks
        q = torch.randn(1, HEADS, HEAD_DIM)
        lens = torch.tensor([context], dtype=torch.int32)
        inputs = [q, k_cache, v_cache, table, lens.to(torch.int64)]
        compiled = cpu_compile.compile_graph(fn, inputs)
        table_eager = blocks[None].int()

        def eager(q=q, table=table_eager, lens=lens):
            return paged_decode_attention(q, k_cache, v_cache, table, lens, scale)

        eager_us = _time_us(eager)
        graph_us = _time_us(lambda c=compiled, ins=inputs: c(*ins))
        rows.append({"context": context, "eager_us": eager_us, "graph_us": graph_us})
        print(f"  attention, {context} tokens: eager {eager_us:.0f} us, graph {graph_us:.0f} us", flush=True)
    return rows


def linear_row() -> dict:
    import torch

    from tessel.kernels import cpu_compile
    from tessel.kernels.quantize_rows import per_token_codes as quantize_rows_formula
    from tessel.kernels.w8a16_cpu import gemv_scaled_formula

    n, k = 3072, 576
    x, w, w_scale = torch.randn(1, k), torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)

    def inlined(x, w, w_scale):
        codes, scale = quantize_rows_formula(x)
        return (gemv_scaled_formula(codes, w, scale, w_scale),)

    def stored(x, w, w_scale):
        codes, scale = quantize_rows_formula(x)
        return gemv_scaled_formula(codes, w, scale, w_scale), codes

    inputs = [x, w, w_scale]
    times = {}
    for name, fn in (("codes_inlined_us", inlined), ("codes_stored_us", stored)):
        compiled = cpu_compile.compile_graph(fn, inputs)
        times[name] = _time_us(lambda c=compiled: c(*inputs))
    print(f"  W8A8 1 x {n} x {k}: codes inlined {times['codes_inlined_us']:.0f} us, "
          f"stored {times['codes_stored_us']:.0f} us", flush=True)  # fmt: skip
    return {"shape": [1, n, k], **times}


def first_steps(model: str, rows: int = 1, steps: int = 40) -> dict:
    """Per-step seconds of `rows` sequences decoding together in a fresh engine (inductor's cache is
    empty here), through the compiled CPU graph where it takes them (`tessel.engine.cpu_graph`)."""
    from tessel import LLM, SamplingParams

    llm = LLM(model, max_model_len=256, lm_head="int8")
    times: list[float] = []
    original = llm.runner._forward

    def timed(*args):
        with _harness.stopwatch() as step:
            out = original(*args)
        times.append(step.wall_s)
        return out

    llm.runner._forward = timed
    prompts = [f"The history of {i}" for i in range(rows)]  # prefilled in one step
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    decode = times[1:]  # the first call is the prefill
    later = statistics.median(decode[-10:])
    print(f"  {model}, {rows} row(s): first decode step {decode[0]:.2f} s (compiling), "
          f"later steps {later * 1e3:.1f} ms; "
          f"{sum(t > 0.2 for t in decode)} steps over 0.2 s", flush=True)  # fmt: skip
    return {"model": model, "rows": rows, "step_s": decode, "median_last_10_s": later}


def ppl_windows(model: str, windows: int, tokens: int = 256, stride: int = 400) -> list[dict]:
    import math

    from transformers import AutoTokenizer

    _harness.tests_module("decode_steps")  # what real_model.token_nll imports, loaded first
    token_nll = _harness.tests_module("real_model").token_nll
    text = (Path(__file__).parent / "data" / "kjv_evaluation.txt").read_text(encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    rows = []
    for w in range(windows):
        window = ids[1000 + w * stride : 1000 + w * stride + tokens]
        prefill, _ = token_nll(Path(model), window, decode=False)
        compiled, steps = token_nll(Path(model), window, decode=True)
        eager, _ = token_nll(Path(model), window, decode=True, enforce_eager=True)
        row = {"window": w, "prefill_nll": prefill, "compiled_nll": compiled, "eager_nll": eager,
               "compiled_steps": steps, "compiled_vs_prefill_pct": 100 * (math.exp(compiled - prefill) - 1),
               "eager_vs_prefill_pct": 100 * (math.exp(eager - prefill) - 1)}  # fmt: skip
        rows.append(row)
        print(f"  window {w}: perplexity vs prefill, compiled {row['compiled_vs_prefill_pct']:+.2f}%, "
              f"eager {row['eager_vs_prefill_pct']:+.2f}%", flush=True)  # fmt: skip
    return rows


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="128,512,2048")
    parser.add_argument("--model", help="a quantised checkpoint: time its first decode steps (cold cache)")
    parser.add_argument("--rows", type=int, default=1, help="with --model: sequences decoding together")
    parser.add_argument("--ppl-windows", type=int, default=0, help="with --model: perplexity windows")
    _harness.add_record_options(parser, "decode_graph")
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="tessel-inductor-")  # a cold cache
    import torch

    torch.set_num_threads(args.threads)
    print(_harness.machine_line())
    result = {"torch": torch.__version__, "threads": args.threads}
    result["attention"] = attention_rows([int(c) for c in args.contexts.split(",")])
    result["w8a8_linear"] = linear_row()
    if args.model:
        result["first_steps"] = first_steps(args.model, args.rows)
    if args.model and args.ppl_windows:
        result["ppl_windows"] = ppl_windows(args.model, args.ppl_windows)
    print("\n| one-row attention (9/3 heads, D 64) | eager us | graph us | eager / graph |")
    print("|---|---|---|---|")
    for row in result["attention"]:
        ratio = row["eager_us"] / row["graph_us"]
        print(f"| {row['context']} tokens | {row['eager_us']:.0f} | {row['graph_us']:.0f} | {ratio:.2f}x |")
    lin = result["w8a8_linear"]
    print(f"\nW8A8 1 x 3072 x 576 in a graph: codes recomputed per channel {lin['codes_inlined_us']:.0f} us, "
          f"stored {lin['codes_stored_us']:.0f} us "
          f"({lin['codes_inlined_us'] / lin['codes_stored_us']:.2f}x)")  # fmt: skip
    _harness.append_record(args.out, "decode_graph", result, args.label)


if __name__ == "__main__":
    main()
