"""How far each int4 grid is from SmolLM2's weights: relative error ||Q(W) - W|| / ||W|| per grid.

    python benchmarks/int4_grids.py [--model DIR] [--out PATH.jsonl]

SmolLM2-135M-Instruct reaches tessel as its Q4_1 GGUF de-quantised (`tessel example-model`): every
block of 32 weights is a float minimum plus 16 evenly spaced levels. This shows what that means for
re-quantising it to int4: symmetric groups (tessel's and compressed-tensors' w4a16, scale max|w| / 7.5
over [-8, 7]), asymmetric groups with an integer zero point (compressed-tensors' asymmetric int4),
and the block-of-32 float-minimum grid of Q4_1 itself, over every decoder-layer linear. Each run
appends a record to benchmarks/results/int4_grids.jsonl.
"""

from __future__ import annotations

import argparse

import _harness
import torch
from safetensors.torch import load_file


def symmetric(rows: torch.Tensor) -> torch.Tensor:
    scale = rows.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 7.5
    return torch.clamp(torch.round(rows / scale), -8, 7) * scale


def asymmetric_integer_zero(rows: torch.Tensor) -> torch.Tensor:
    lo = rows.amin(-1, keepdim=True).clamp(max=0.0)
    hi = rows.amax(-1, keepdim=True).clamp(min=0.0)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    zero = torch.clamp(-8 - torch.round(lo / scale), -8, 7)
    return (torch.clamp(torch.round(rows / scale) + zero, -8, 7) - zero) * scale


def float_minimum(rows: torch.Tensor) -> torch.Tensor:
    """Q4_1's grid: min + d * q, q in [0, 15], d = (max - min) / 15."""
    lo, hi = rows.amin(-1, keepdim=True), rows.amax(-1, keepdim=True)
    step = ((hi - lo) / 15).clamp(min=1e-12)
    return torch.clamp(torch.round((rows - lo) / step), 0, 15) * step + lo


GRIDS = {"symmetric": symmetric, "asymmetric, integer zero point": asymmetric_integer_zero,
         "float minimum (Q4_1)": float_minimum}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct from the cache)")
    _harness.add_record_options(parser, "int4_grids")
    args = parser.parse_args()
    model = _harness.example_model(args.model)
    tensors = {}
    for file in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    weights = [t.float() for name, t in tensors.items() if name.startswith("model.layers.") and t.dim() == 2]
    table = {}
    for group in (32, 64):
        for grid, fn in GRIDS.items():
            err = sum(
                float((fn(w.reshape(w.shape[0], -1, group)).reshape(w.shape) - w).square().sum())
                for w in weights
            )
            norm = sum(float(w.square().sum()) for w in weights)
            table[f"{grid}, group {group}"] = (err / norm) ** 0.5
    print(
        f"{len(weights)} decoder-layer linears of {model}\n\n| int4 grid | relative weight error |\n|---|---|"
    )
    for name, value in table.items():
        print(f"| {name} | {value:.4f} |")
    _harness.append_record(args.out, "int4_grids", {"model": str(model), "relative_error": table}, args.label)


if __name__ == "__main__":
    main()
