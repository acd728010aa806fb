"""fp32 CPU GEMMs: PyTorch's `nn.Linear` against tessel's oneDNN-packed `PackedLinear`.

    python benchmarks/packed_linear.py [--threads 1] [--repeats 15] [--out PATH.jsonl]

Shapes are the engine benchmark model's (hidden 512, fused gate/up 3072, LM head 32000) at a
decode batch (32 rows), one prefill tile (256) and a long prefill (2048). Both providers get the
same float32 weight and input; they are timed interleaved (3 x `--repeats` calls each, after a
warm-up call: oneDNN builds its primitive on the first call of a shape) and the median per call is
reported, with speedup = nn.Linear / PackedLinear and the largest error of each against float64.
Each run appends a record to benchmarks/results/packed_linear.jsonl.
"""

from __future__ import annotations

import argparse

import _harness
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from tessel.layers.linear import packed_linear as PackedLinear
from tessel.layers.linear import packing_available

SHAPES = [(rows, 512, out) for out in (512, 3072, 32000) for rows in (32, 256, 2048)]
ROUNDS = 3  # x --repeats timed calls of each provider


def measure(rows: int, in_features: int, out_features: int, repeats: int) -> dict:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False)
    packed = PackedLinear(linear.weight, None)
    x = torch.randn(rows, in_features)
    reference = x.double() @ linear.weight.double().T
    with torch.inference_mode():
        errors = {
            name: float((fn(x).double() - reference).abs().max())
            for name, fn in (("torch", linear), ("packed", packed))
        }
        timed = _harness.time_calls(
            {"torch": lambda: linear(x), "packed": lambda: packed(x)}, warmup=1, repeats=ROUNDS * repeats
        )
    t, p = timed["torch"].median_ms, timed["packed"].median_ms
    return {
        "shape": [rows, in_features, out_features],
        "torch_ms": t,
        "packed_ms": p,
        "speedup": t / p,
        "max_abs_error": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    _harness.add_record_options(parser, "packed_linear")
    args = parser.parse_args()
    if not packing_available():
        raise SystemExit("this PyTorch build has no oneDNN linear packing")
    torch.set_num_threads(args.threads)
    rows = [measure(*shape, args.repeats) for shape in SHAPES]
    table = Table(title=f"fp32 linear on CPU, {args.threads} thread(s): nn.Linear vs PackedLinear (median)")
    for column in (
        "rows x in x out",
        "nn.Linear ms",
        "PackedLinear ms",
        "speedup",
        "max err torch",
        "max err packed",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            " x ".join(map(str, row["shape"])),
            f"{row['torch_ms']:.3f}",
            f"{row['packed_ms']:.3f}",
            f"{row['speedup']:.2f}x",
            f"{row['max_abs_error']['torch']:.1e}",
            f"{row['max_abs_error']['packed']:.1e}",
        )
    Console(width=140).print(table)
    document = {"threads": args.threads, "repeats": args.repeats, "results": rows}
    _harness.append_record(args.out, "packed_linear", document, args.label)


if __name__ == "__main__":
    main()
