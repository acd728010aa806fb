"""The W8A16 CPU options over a whole model's decoder linears, as a decode step meets them.

    python benchmarks/w8a16_cpu_options.py [--rows 1,32] [--layers 30] [--repeats 5] [--out PATH.jsonl]

SmolLM2-135M's four linear shapes (qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536)
x `--layers` layers, each with its own random weight, so the weights stream from DRAM as in a real
step (a single hot layer sits in cache and flatters compute-bound kernels). Per option the time of
one pass over all of them (median of interleaved repeats, 1 thread):

- fp32 oneDNN: the engine's float32 GEMM on the de-quantised weight (`PackedLinear`);
- compiled GEMV: tessel's `gemv_int8` (inductor-fused int8 reduction, float32 activations);
- int8pack bf16 / fp32: `torch._weight_int8pack_mm` with bfloat16 / float32 activations;
- oneDNN bf16: oneDNN's bfloat16 GEMM on the int8 values packed as bfloat16 (`bf16` path, many rows);
- fbgemm fp16 codes: the int8 codes as float16 in fbgemm's fp16-weight GEMM, float32 activations
  (the `fbgemm` W8A16 path, `tessel.kernels.int8_cpu`);
- fbgemm int8 (W8A8): fbgemm's dynamic int8 GEMM on rows scaled per token (the `fbgemm` W8A8 path),
  for comparison: it quantises the activations.

The CPU's features are printed first: the ranking differs between AVX2-only and AVX-512 CPUs.
Each run appends a record to benchmarks/results/w8a16_cpu_options.jsonl.
"""

from __future__ import annotations

import argparse

import _harness
import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def build(layers: int) -> list[dict]:
    from tessel.kernels.int8_cpu import fbgemm_pack, fp16_codes_pack
    from tessel.kernels.quantize_rows import quantize_per_token
    from tessel.layers.linear import BATCH_HINT
    from tessel.layers.linear import packed_linear as PackedLinear

    out = []
    for _ in range(layers):
        for n, k in SHAPES:
            w = torch.randn(n, k) / k**0.5
            q, s = quantize_per_token(w)
            try:  # oneDNN packs bfloat16 only on AVX-512 (or AVX-NE-CONVERT) CPUs
                w16 = torch.ops.mkldnn._reorder_linear_weight(q.bfloat16(), BATCH_HINT)
            except RuntimeError:
                w16 = None
            fp32 = PackedLinear(q.float() * s[:, None], None)
            out.append({"k": k, "q": q, "s": s, "s16": s.bfloat16(), "fp32": fp32, "w16": w16,
                        "fp16": fp16_codes_pack(q), "int8": fbgemm_pack(q, s)})  # fmt: skip
    return out


def options(layers: list[dict], rows: int) -> dict:
    from tessel.kernels.int8_cpu import fbgemm_linear, fp16_codes_linear
    from tessel.kernels.w8a16_cpu import gemv_int8

    xs = {k: torch.randn(rows, k) for k in (576, 1536)}

    def run(fn):
        return lambda: [fn(layer, xs[layer["k"]]) for layer in layers]

    found = {
        "fp32 oneDNN": run(lambda lin, x: lin["fp32"](x)),
        "int8pack bf16": run(
            lambda lin, x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), lin["q"], lin["s16"])
        ),
        "fbgemm fp16 codes": run(lambda lin, x: fp16_codes_linear(x, lin["fp16"], lin["s"], None)),
        "fbgemm int8 (W8A8)": run(lambda lin, x: fbgemm_linear(x, lin["int8"], None)),
    }
    if layers[0]["w16"] is not None:
        found["oneDNN bf16"] = run(
            lambda lin, x: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), lin["w16"], None, "none", [], "")
        )
    if rows == 1:
        found["compiled GEMV"] = run(lambda lin, x: gemv_int8(x, lin["q"], lin["s"]))
        found["int8pack fp32"] = run(lambda lin, x: torch.ops.aten._weight_int8pack_mm(x, lin["q"], lin["s"]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    _harness.add_record_options(parser, "w8a16_cpu_options")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(_harness.machine_line())
    result = {"layers": args.layers, "repeats": args.repeats, "threads": 1, "rows": []}
    layers = build(args.layers)
    print(f"| rows | option | ms per pass over {len(layers)} linears | vs fp32 oneDNN |\n|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        found = options(layers, rows)
        with torch.inference_mode():  # one warm-up round (and compilation), then interleaved
            timed = _harness.time_calls(found, warmup=1, repeats=args.repeats)
        base = timed["fp32 oneDNN"].median_s
        for name, timing in timed.items():
            med = timing.median_s
            print(f"| {rows} | {name} | {med * 1e3:.1f} | {base / med:.2f}x |", flush=True)
            result["rows"].append({"rows": rows, "option": name, "ms": med * 1e3, "vs_fp32": base / med})
    _harness.append_record(args.out, "w8a16_cpu_options", result, args.label)


if __name__ == "__main__":
    main()
