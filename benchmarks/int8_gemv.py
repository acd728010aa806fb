"""One-row W8A8 sums over a whole model's linears (issue 47): tessel's int8 GEMV against the CPU
paths it replaces, each beside the memory's read bandwidth, one thread.

    python benchmarks/int8_gemv.py [--model DIR] [--rounds 9] [--only kernels,engine,step]
        [--out PATH.jsonl] [--label NAME]

A decode step of one sequence reads every decoder linear's weight once, one byte per weight with
int8: on SmolLM2-135M (the default model; its config only, the weights are random int8 codes)
30 layers of qkv, o, gate_up and down, then the LM head, 134 MB, far past the caches, so each
kernel streams its weights from memory as in a real step. Per round each kernel runs the whole
sequence of linears once (interleaved, the order rotated each round); a figure is the median over
`--rounds` rounds:

    tessel vnni    `tessel.kernels.int8_gemv`, AVX-512 VNNI (where the CPU has it)
    tessel avx2    the same, AVX2's kernel (runs on any AVX2 CPU, this one included)
    inductor GEMV  the compiled float32 GEMV (`gemv_int8_scaled`, its epilogue included): VNNI's
                   one row before the kernel
    fbgemm int8    fbgemm's int8 GEMM on one row of codes (`fbgemm_int8_sums`)
    fp16codes      fbgemm's fp16-weight GEMM on the codes (AVX2's one row before the kernel)

`--only engine` (or both, the default): one stream of SmolLM2 W8A8 + int8 LM head decoding
`--new-tokens` greedy tokens after a 64-token prompt, tessel's engine four ways: the native one-row
step (`tessel.kernels.decode_row`: every layer in one C++ call, the default; again with its weights
left on 4 KB pages, `TESSEL_HUGE_PAGES=off`, `tessel.kernels.huge_pages`), the compiled graphs
calling the kernel (`TESSEL_DECODE_ROW=off`), and the graphs with inductor's GEMV (also
`TESSEL_INT8_GEMV=off`, the step before the kernel), beside llama.cpp's Q8_0 of
the same model (`peers.py`'s re-quantised GGUF) where llama-cpp-python is installed (the benchmark
venv, docs/quant.md); engines interleaved per round, the first round untimed; figures are medians
of tok/s and of each round's ratios. A last row, `weights read once (ceiling)`, times a read of the
step's int8 weight bytes alone (a float32 buffer of that size summed) in the same rounds, as tok/s:
the most a one-thread step could reach at this moment's memory speed (the KV cache's reads left
out), so its ratio over llama.cpp bounds every engine's.

`--only step`: the native operator alone, called on the same W8A8 checkpoint (the engine's own
layers and cache) for one row at `--contexts` (default 1, 128, 512 tokens; a sequential block
table), and the LM head on one row, each twice (weights on huge pages, the default, and on 4 KB
pages, `TESSEL_HUGE_PAGES=off`), beside a read of the operator's bytes (a float32 buffer of that
size summed), interleaved, `--step-rounds` rounds: at the first context the row is its GEMVs and the
small work between them, so its share of the read's speed is what the GEMVs stream at inside the
step; each further context adds the attention's cost per 1k tokens of context.

AVX2's paths on an AVX-512 machine (a stand-in, not an AVX2-only CPU: fbgemm and llama.cpp still
use AVX-512 there): `ATEN_CPU_CAPABILITY=avx2 TESSEL_INT8_PATH=fp16codes TESSEL_NATIVE_ARCH=x86-64-v3
python benchmarks/int8_gemv.py --only engine --kernel avx2` runs PyTorch's and inductor's AVX2 code,
AVX2's default W8A8 path (`fp16codes`), the AVX2 kernel and the native step as an AVX2-only CPU
builds it, against the same path with inductor's GEMV... which `fp16codes` does not take: the
"inductor GEMV" engine is then the fbgemm fp16 GEMM at one row, AVX2's one row before the kernel.

`GB/s` is the weight bytes over the time (fp16codes reads 2 bytes a weight: its figure counts the
int8 bytes, as the work done), `of read` its share of `measure_read_gbs` (a float32 buffer summed,
best of 7) taken after the rounds. Every kernel's sums are checked against int64 matmul first.
Appends a record to benchmarks/results/int8_gemv.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import _harness
import torch


def model_shapes(model: Path) -> tuple[int, list[tuple[int, int]], tuple[int, int]]:
    """(layers, the decoder linears' [N, K] in a layer's order, the LM head's [N, K])."""
    config = json.loads((model / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = (
        config["num_attention_heads"],
        config.get("num_key_value_heads", config["num_attention_heads"]),
    )
    head_dim = config.get("head_dim") or hidden // heads
    qkv = (heads + 2 * kv) * head_dim
    layer = [(qkv, hidden), (hidden, heads * head_dim), (2 * inter, hidden), (hidden, inter)]
    return config["num_hidden_layers"], layer, (config["vocab_size"], hidden)


def kernels(weights: list[torch.Tensor]) -> dict:
    """name -> (one call on (codes, i) for weight i, its prepared forms) for every kernel this
    machine runs."""
    from tessel.kernels import cpu_features, int8_gemv
    from tessel.kernels.int8_cpu import fbgemm_int8_sums, fbgemm_pack, fp16_codes_matmul, fp16_codes_pack
    from tessel.kernels.w8a16_cpu import gemv_int8_scaled

    found = {}
    flags = cpu_features.cpu_flags()
    for isa, needs in int8_gemv.NEEDS.items():
        if needs <= flags and int8_gemv.available():
            packed = [int8_gemv.pack(w, isa) for w in weights]
            found[f"tessel {isa}"] = lambda c, i, p=packed: int8_gemv.gemv_sums(c, p[i])
    ones = {w.shape[0]: torch.ones(w.shape[0]) for w in weights}
    found["inductor GEMV"] = lambda c, i: gemv_int8_scaled(
        c, weights[i], torch.ones(1), ones[weights[i].shape[0]]
    )
    if cpu_features.fbgemm_available():
        fb = [fbgemm_pack(w, ones[w.shape[0]]) for w in weights]
        found["fbgemm int8"] = lambda c, i: fbgemm_int8_sums(c, fb[i])
        f16 = [fp16_codes_pack(w) for w in weights]
        found["fp16codes"] = lambda c, i: fp16_codes_matmul(c, f16[i])
    return found


def check(found: dict, weights: list[torch.Tensor], codes: dict[int, torch.Tensor]) -> None:
    """Each kernel's sums on the first layer's weights equal int64 matmul's."""
    for name, call in found.items():
        for i, w in enumerate(weights[:4]):
            c = codes[w.shape[1]]
            expected = (c.to(torch.int64) @ w.to(torch.int64).t()).to(torch.float32)
            if not torch.equal(call(c, i), expected):
                raise SystemExit(f"{name}: sums differ from int64 matmul on weight {tuple(w.shape)}")


CEILING = "weights read once (ceiling)"
SMALL_PAGES = "tessel, native step, 4 KB pages"


def _forced() -> dict:
    """The environment that holds the run to other code paths (AVX2's on an AVX-512 CPU)."""
    names = ("ATEN_CPU_CAPABILITY", "TESSEL_INT8_PATH", "TESSEL_NATIVE_ARCH", "TESSEL_INT8_GEMV")
    return {name: os.environ.get(name) for name in names}


def _one_mapping(llm) -> bool:  # noqa: ANN001 (an LLM)
    """Whether the native step's packed layer weights share one storage (moved onto huge pages)."""
    from tessel.engine.native_row import PACKED_AT

    weights = llm.runner.cpu_graph.native_row.weights
    return len({weights[i].untyped_storage().data_ptr() for i in PACKED_AT}) == 1


def weights_read(model: Path):  # noqa: ANN201 (a timed run, as the engines' are)
    """A step that only reads the step's int8 weight bytes (a float32 buffer of that size summed),
    as tok/s, taken in the same rounds as the engines: about the most a one-thread step reaches."""
    layers, layer_shapes, head = model_shapes(model)
    n_bytes = layers * sum(n * k for n, k in layer_shapes) + head[0] * head[1]
    buffer = torch.ones(n_bytes // 4)

    def run() -> float:
        start = time.perf_counter()
        buffer.sum()
        return 1 / (time.perf_counter() - start)

    return run


def engine_rounds(model: Path, args: argparse.Namespace) -> dict:
    """One-stream decode tok/s per engine per round, interleaved (see the module docstring)."""
    import tempfile

    import peers  # benchmarks/peers.py: llama.cpp's Q8_0 and its generate loop

    import quant  # benchmarks/quant.py: the W8A8 checkpoint and tessel's engine as it measures it
    from tessel import SamplingParams

    workdir = Path(tempfile.mkdtemp(prefix="tessel-int8-gemv-"))
    checkpoint = quant._quantize(model, "w8a8 rtn", workdir, 16, 512)
    max_len = 64 + args.new_tokens + 8
    ids = quant.EVAL.read_text(encoding="utf-8")
    engines: dict = {}
    kernel = None if args.kernel == "auto" else {"TESSEL_INT8_GEMV": args.kernel}
    graphs = {"TESSEL_DECODE_ROW": "off"}
    for name, forced in (
        ("tessel, native step", kernel),
        (SMALL_PAGES, {**(kernel or {}), "TESSEL_HUGE_PAGES": "off"}),
        ("tessel, int8 GEMV", {**(kernel or {}), **graphs}),
        ("tessel, inductor GEMV", {"TESSEL_INT8_GEMV": "off", **graphs}),
    ):
        engines[name] = quant._speed_llm(checkpoint, forced, "int8", False, max_len)
    for name in ("tessel, native step", SMALL_PAGES):
        native = engines[name].runner.cpu_graph
        if native is None or native.native_row is None:
            raise SystemExit("the native one-row step is not taken here (no compiler, or no W8A8 int8 GEMV)")
    huge = {name: _one_mapping(engines[name]) for name in ("tessel, native step", SMALL_PAGES)}
    print(f"the native steps' layer weights in one huge-page mapping: {huge}")
    prompt = engines["tessel, int8 GEMV"].tokenizer(ids)["input_ids"][:64]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)

    def tessel_run(llm) -> float:
        out = llm.generate([prompt], params, use_progress=False)[0]
        return (args.new_tokens - 1) / (out.metrics.finish_time - out.metrics.first_token_time)

    runs = {name: (lambda llm=llm: tessel_run(llm)) for name, llm in engines.items()}
    runs[CEILING] = weights_read(model)
    try:
        import llama_cpp

        gguf = peers.llama_q8_0(_harness.example_gguf(), workdir)
        llama = llama_cpp.Llama(
            str(gguf), n_ctx=max_len, n_threads=1, n_threads_batch=1, n_batch=128, verbose=False
        )

        def llama_run() -> float:
            first, last = peers._llama_generate(llama, prompt, args.new_tokens)
            return (args.new_tokens - 1) / (last - first)

        runs["llama.cpp Q8_0"] = llama_run
    except ImportError:
        print("llama-cpp-python is not installed here: tessel's engines only", flush=True)
    tok_s: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for r in range(args.engine_rounds + 1):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            value = runs[name]()
            if r:
                tok_s[name].append(value)
    base = "llama.cpp Q8_0" if "llama.cpp Q8_0" in tok_s else "tessel, inductor GEMV"
    print(f"\none stream, {args.new_tokens} tokens after 64, {args.engine_rounds} rounds (medians)")
    print(f"| engine | tok/s | vs {base} |")
    print("|---|---|---|")
    rows = {}
    for name, values in tok_s.items():
        ratio = statistics.median(v / b for v, b in zip(values, tok_s[base], strict=True))
        rows[name] = {"tok_per_s": statistics.median(values), "runs": values, f"vs {base}": ratio}
        print(f"| {name} | {rows[name]['tok_per_s']:.1f} | {ratio:.2f}x |")
    gemv = [a / b for a, b in zip(tok_s["tessel, int8 GEMV"], tok_s["tessel, inductor GEMV"], strict=True)]
    print(f"int8 GEMV over inductor's, same rounds: {statistics.median(gemv):.2f}x")
    step = [a / b for a, b in zip(tok_s["tessel, native step"], tok_s["tessel, int8 GEMV"], strict=True)]
    print(f"native step over the graphs (both on the int8 GEMV), same rounds: {statistics.median(step):.2f}x")
    pages = [a / b for a, b in zip(tok_s["tessel, native step"], tok_s[SMALL_PAGES], strict=True)]
    print(f"native step on huge pages over 4 KB pages, same rounds: {statistics.median(pages):.2f}x")
    of_ceiling = [a / b for a, b in zip(tok_s["tessel, native step"], tok_s[CEILING], strict=True)]
    print(f"native step's share of the ceiling, same rounds: {statistics.median(of_ceiling):.0%}")
    forced = _forced()
    return {"new_tokens": args.new_tokens, "rounds": args.engine_rounds, "base": base, "rows": rows,
            "kernel": args.kernel, "environment": forced,
            "int8_gemv_over_inductor": statistics.median(gemv),
            "native_step_over_graphs": statistics.median(step),
            "native_step_of_ceiling": statistics.median(of_ceiling),
            "huge_over_small_pages": statistics.median(pages), "one_mapping": huge}  # fmt: skip


PAGES = {"": None, ", 4 KB pages": {"TESSEL_HUGE_PAGES": "off"}}


def step_rounds(model: Path, args: argparse.Namespace) -> dict:
    """The native operator and the LM head alone on the quantised model at a few contexts, on huge
    pages and on 4 KB pages, beside a read of the bytes the operator reads, interleaved (see the
    module docstring)."""
    import tempfile

    import quant

    contexts = [int(c) for c in args.contexts.split(",")]
    checkpoint = quant._quantize(
        model, "w8a8 rtn", Path(tempfile.mkdtemp(prefix="tessel-int8-gemv-")), 16, 512
    )
    calls: dict = {}
    for suffix, forced in PAGES.items():
        llm = quant._speed_llm(checkpoint, forced, "int8", False, max(contexts) + 16)
        native = llm.runner.cpu_graph.native_row if llm.runner.cpu_graph is not None else None
        if native is None:
            raise SystemExit("the native one-row step is not taken here (no compiler, or no W8A8 int8 GEMV)")
        calls.update({f"{name}{suffix}": call for name, call in _step_calls(llm, native, contexts).items()})
    n_bytes = sum(w.numel() * w.element_size() for w in native.weights)
    buffer = torch.ones(n_bytes // 4)
    calls["read of its bytes"] = buffer.sum
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for r in range(args.step_rounds + 1):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            start = time.perf_counter()
            calls[name]()
            if r:
                times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(runs) * 1e3 for name, runs in times.items()}
    print(f"\nthe native operator, {len(native.layers)} layers, {n_bytes / 1e6:.1f} MB of its tensors, "
          f"{args.step_rounds} rounds (medians)")  # fmt: skip
    print("| call | ms | of the read's speed | over the first context, per 1k tokens of context |")
    print("|---|---|---|---|")
    rows = {}
    for name, value in ms.items():
        context, _, suffix = name.removeprefix("context ").partition(",")
        extra = None
        if name.startswith("context ") and int(context) != contexts[0]:
            first = ms[f"context {contexts[0]}" + (f",{suffix}" if suffix else "")]
            extra = (value - first) / (int(context) - contexts[0]) * 1e3
        of_read = ms["read of its bytes"] / value if not name.startswith("LM head") else None
        rows[name] = {"ms": value, "runs_ms": [t * 1e3 for t in times[name]],
                      "of_read": of_read, "ms_per_1k_context": extra}  # fmt: skip
        shown = "" if extra is None else f"{extra:.2f} ms"
        print(f"| {name} | {value:.2f} | {'' if of_read is None else f'{of_read:.0%}'} | {shown} |")
    small = {name: times[f"{name}, 4 KB pages"] for name in ms if f"{name}, 4 KB pages" in ms}
    pages = {
        name: statistics.median(a / b for a, b in zip(runs, times[name], strict=True))
        for name, runs in small.items()
    }
    print(
        "huge pages over 4 KB pages (the rounds' ratios): "
        + ", ".join(f"{n} {r:.3f}x" for n, r in pages.items())
    )
    return {"contexts": contexts, "bytes": n_bytes, "rounds": args.step_rounds, "rows": rows,
            "huge_over_small_pages": pages, "environment": _forced()}  # fmt: skip


def _step_calls(llm, native, contexts: list[int]) -> dict:  # noqa: ANN001 (an LLM, its NativeRow)
    """One row through the native operator at each context (a sequential block table), and the LM head."""
    from tessel.kernels.rope import rope_tables
    from tessel.layers.attention import AttentionMetadata, DecodeGroup

    cache = native.layers[0].self_attn.attn.k_cache
    blocks, block_size = cache.shape[:2]
    if -(-max(contexts) // block_size) > blocks:
        raise SystemExit(
            f"the engine's cache holds {blocks * block_size} tokens; --contexts asks {max(contexts)}"
        )
    rotary = llm.model.model.rotary
    hidden = torch.randn(1, llm.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    calls = {}
    for context in contexts:
        table = torch.arange(-(-context // block_size), dtype=torch.int32)
        position = torch.tensor([context - 1])
        group = DecodeGroup(0, 1, table[None], torch.tensor([context], dtype=torch.int32))
        meta = AttentionMetadata(torch.tensor([context - 1]), 1, [group])
        tables = rope_tables(position, rotary.cos, rotary.sin)
        calls[f"context {context}"] = lambda meta=meta, tables=tables: native(hidden, meta, tables)
    calls["LM head"] = lambda: llm.model.lm_head(hidden)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct from the cache)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--only", default="kernels,engine", help="comma list of kernels, engine, step")
    parser.add_argument("--engine-rounds", type=int, default=5)
    parser.add_argument("--step-rounds", type=int, default=40)
    parser.add_argument(
        "--contexts", default="1,128,512", help="--only step: context lengths, the first the base"
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--kernel", default="auto", help="the engine's int8 GEMV: auto (by the CPU), vnni, avx2"
    )
    _harness.add_record_options(parser, "int8_gemv")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(_harness.machine_line())
    model = Path(args.model) if args.model else _harness.example_model()
    result: dict = {"model": model.name}
    only = set(args.only.split(","))
    if "kernels" in only:
        result["kernels"] = kernel_rounds(model, args)
    if "engine" in only:
        result["engine"] = engine_rounds(model, args)
    if "step" in only:
        result["step"] = step_rounds(model, args)
    _harness.append_record(args.out, "int8_gemv", result, args.label)


def kernel_rounds(model: Path, args: argparse.Namespace) -> dict:
    """Each kernel's time over the model's linears, interleaved (see the module docstring)."""
    layers, layer_shapes, head = model_shapes(model)
    g = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(layers) for s in layer_shapes] + [head]
    weights = [torch.randint(-127, 128, s, generator=g, dtype=torch.int8) for s in shapes]
    codes = {k: torch.randint(-127, 128, (1, k), generator=g).float() for k in {s[1] for s in shapes}}
    found = kernels(weights)
    check(found, weights, codes)
    nbytes = sum(w.numel() for w in weights)
    times: dict[str, list[float]] = {name: [] for name in found}
    order = list(found)
    for r in range(args.rounds + 1):  # round 0 warms up (inductor compiles its shapes)
        for name in order[r % len(order) :] + order[: r % len(order)]:
            call = found[name]
            start = time.perf_counter()
            for i, w in enumerate(weights):
                call(codes[w.shape[1]], i)
            if r:
                times[name].append(time.perf_counter() - start)
    from tessel.profiling.device_bench import measure_read_gbs

    read_gbs = measure_read_gbs()
    rows = {}
    base = statistics.median(times["inductor GEMV"])
    print(f"\n{len(weights)} linears ({layers} layers + LM head), {nbytes / 1e6:.1f} MB of int8 weights; "
          f"read bandwidth {read_gbs:.1f} GB/s (one thread)")  # fmt: skip
    print("| kernel | ms per step | GB/s | of read | vs inductor GEMV |")
    print("|---|---|---|---|---|")
    for name, runs in times.items():
        median = statistics.median(runs)
        gbs = nbytes / median / 1e9
        rows[name] = {"ms": median * 1e3, "runs_ms": [t * 1e3 for t in runs], "gb_per_s": gbs,
                      "of_read": gbs / read_gbs, "vs_inductor": base / median}  # fmt: skip
        print(f"| {name} | {median * 1e3:.2f} | {gbs:.1f} | {gbs / read_gbs:.0%} | {base / median:.2f}x |")
    return {"shapes": {"layers": layers, "layer": layer_shapes, "head": head}, "weight_bytes": nbytes,
            "rounds": args.rounds, "read_gbps": read_gbs, "rows": rows}  # fmt: skip


if __name__ == "__main__":
    main()
