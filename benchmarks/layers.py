"""Per-layer latency of a Llama-shaped decoder layer's linears: nn.Linear vs tessel's layers.

    python benchmarks/layers.py [--quick] [--model tinyllama|llama-7b] [--tokens 256 16]
                                [--out benchmarks/results/layers.jsonl]

Builds the seven projections of one decoder layer (q, k, v, o, gate, up, down) from the same
float weights as `nn.Linear`, tessel `Linear`, `W8A8Linear` (W8A8) and `W8A16Linear`, then runs
the layer's matmul chain layer by layer (q/k/v/gate/up on the hidden state, o on the attention
width, down on silu(gate) * up) for a prefill chunk and a decode batch. Providers are timed
interleaved (median and min of the runs; min is the steadier number on a shared CPU; CUDA events
on a GPU). On CUDA the float baseline is fp16, on CPU fp32. speedup = nn.Linear time / provider
time. Each run appends a record to benchmarks/results/layers.jsonl.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import _harness
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """The widths of one Llama-family decoder layer (names as in HF config.json)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def projections(self) -> dict[str, tuple[int, int]]:
        """name -> (in_features, out_features)."""
        h, d = self.hidden_size, self.head_dim
        return {
            "q_proj": (h, self.num_attention_heads * d),
            "k_proj": (h, self.num_key_value_heads * d),
            "v_proj": (h, self.num_key_value_heads * d),
            "o_proj": (self.num_attention_heads * d, h),
            "gate_proj": (h, self.intermediate_size),
            "up_proj": (h, self.intermediate_size),
            "down_proj": (self.intermediate_size, h),
        }


MODELS = {
    # TinyLlama-1.1B config.json: hidden 2048, 32 heads, 4 KV heads, FFN 5632.
    "tinyllama": DecoderShape(2048, 32, 4, 5632),
    # Llama-2-7B config.json: hidden 4096, 32 heads, 32 KV heads, FFN 11008.
    "llama-7b": DecoderShape(4096, 32, 32, 11008),
}
PROVIDERS = ("nn.Linear", "tessel Linear", "W8A8Linear", "W8A16Linear")


def build_layers(shape: DecoderShape, device: str, dtype: torch.dtype) -> dict[str, dict[str, nn.Module]]:
    """provider -> projection name -> module, all holding the same float weights."""
    from tessel.layers import Linear, W8A8Linear, W8A16Linear

    layers: dict[str, dict[str, nn.Module]] = {p: {} for p in PROVIDERS}
    for name, (fan_in, fan_out) in shape.projections().items():
        ref = nn.Linear(fan_in, fan_out, bias=False, device=device, dtype=dtype)
        layers["nn.Linear"][name] = ref
        layers["tessel Linear"][name] = Linear.from_linear(ref)
        layers["W8A8Linear"][name] = W8A8Linear.from_linear(ref)
        layers["W8A16Linear"][name] = W8A16Linear.from_linear(ref)
    return layers


def layer_inputs(
    shape: DecoderShape, tokens: int, device: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    hidden = torch.randn(tokens, shape.hidden_size, device=device, dtype=dtype)
    attn = torch.randn(tokens, shape.num_attention_heads * shape.head_dim, device=device, dtype=dtype)
    act = F.silu(torch.randn(tokens, shape.intermediate_size, device=device, dtype=dtype))
    return {"hidden": hidden, "attn": attn, "act": act}


INPUT_OF = {"o_proj": "attn", "down_proj": "act"}  # every other projection reads the hidden state


def run_chain(modules: dict[str, nn.Module], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The decoder layer's matmuls in order; attention itself is not part of this benchmark."""
    h = inputs["hidden"]
    q, _k, _v = modules["q_proj"](h), modules["k_proj"](h), modules["v_proj"](h)
    o = modules["o_proj"](q)  # q has the attention output's width
    act = F.silu(modules["gate_proj"](h)) * modules["up_proj"](h)
    return modules["down_proj"](act) + o


def time_interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, device: str
) -> dict[str, tuple[float, float]]:
    """provider -> (median ms, min ms), providers run in turn so load changes hit all alike."""
    clock = "cuda" if device == "cuda" else "wall"
    timed = _harness.time_calls(fns, warmup=2, repeats=repeats, clock=clock)
    return {name: (t.median_ms, t.min_ms) for name, t in timed.items()}


@dataclass(slots=True)
class Row:
    model: str
    tokens: int
    layer: str
    shape: str
    ms_median: dict[str, float]
    ms_min: dict[str, float]
    speedup_median: dict[str, float]  # nn.Linear median / provider median
    speedup_min: dict[str, float]


def projection_call(layers: dict[str, dict[str, nn.Module]], name: str, inputs: dict[str, torch.Tensor]):
    x = inputs[INPUT_OF.get(name, "hidden")]
    return lambda provider: layers[provider][name](x)


def chain_call(layers: dict[str, dict[str, nn.Module]], inputs: dict[str, torch.Tensor]):
    return lambda provider: run_chain(layers[provider], inputs)


def bench_model(model: str, tokens_list: list[int], device: str, repeats: int) -> list[Row]:
    shape = MODELS[model]
    dtype = torch.float16 if device == "cuda" else torch.float32
    layers = build_layers(shape, device, dtype)
    rows: list[Row] = []
    for tokens in tokens_list:
        inputs = layer_inputs(shape, tokens, device, dtype)
        cases = {name: projection_call(layers, name, inputs) for name in shape.projections()}
        cases["decoder linears (chain)"] = chain_call(layers, inputs)
        for case, call in cases.items():
            fns = {provider: (lambda provider=provider, call=call: call(provider)) for provider in PROVIDERS}
            timings = time_interleaved(fns, repeats, device)
            fan = shape.projections().get(case)
            text = f"{tokens}x{fan[0]}->{fan[1]}" if fan else f"{tokens} tokens"
            base_med, base_min = timings["nn.Linear"]
            rows.append(
                Row(
                    model,
                    tokens,
                    case,
                    text,
                    {p: t[0] for p, t in timings.items()},
                    {p: t[1] for p, t in timings.items()},
                    {p: base_med / t[0] for p, t in timings.items()},
                    {p: base_min / t[1] for p, t in timings.items()},
                )  # fmt: skip
            )
    return rows


def print_table(rows: list[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("model", "tokens", "layer", "shape"):
        table.add_column(column)
    for provider in PROVIDERS:
        table.add_column(f"{provider} ms (x)", justify="right")
    for row in rows:
        cells = [f"{row.ms_min[p]:.2f} ({row.speedup_min[p]:.2f}x)" for p in PROVIDERS]
        table.add_row(row.model, str(row.tokens), row.layer, row.shape, *cells)
    Console(width=170).print(table)
    print("ms = min over interleaved runs; (x) = nn.Linear min / provider min")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tinyllama widths, fewer repeats")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--model", choices=sorted(MODELS), default=None)
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[256, 16], help="prefill chunk, decode batch"
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 is steadier on a shared CPU",
    )
    _harness.add_record_options(parser, "layers")
    args = parser.parse_args()

    model = args.model or ("llama-7b" if args.device == "cuda" and not args.quick else "tinyllama")
    repeats = args.repeats or (3 if args.quick else 10)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = os.getloadavg()
    with torch.no_grad():  # not inference_mode: W8A8Linear reads its weight's version counter
        rows = bench_model(model, args.tokens, args.device, repeats)
    where = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    )
    print_table(rows, f"decoder-layer linears of {model} on {where} (load {load_before[0]:.1f})")
    payload = {
        "device": args.device,
        "where": where,
        "torch": torch.__version__,
        "model": model,
        "shape": asdict(MODELS[model]),
        "repeats": repeats,
        "load_average_1_5_15min_before_after": [load_before, os.getloadavg()],
        "rows": [asdict(row) for row in rows],
    }
    _harness.append_record(args.out, "layers", payload, args.label)


if __name__ == "__main__":
    main()
