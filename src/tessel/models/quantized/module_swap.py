"""Run a compressed-tensors checkpoint in the engine: swap the model's linears for quantised ones.

gpt-fast style: the model is built as usual (on the meta device), its decoder-layer linears are
replaced by placeholders before memory is allocated, the float tensors load as usual, then each
linear is rebuilt from the checkpoint's quantised tensors (q/k/v and gate/up concatenated into
tessel's fused `qkv_proj` / `gate_up_proj`):

    w8a8          -> `W8A8Linear` (int8 GEMM; CPU path by the CPU's features)
    w8a16 on CUDA -> `W8A16Linear` (Triton kernel, int8 weights in memory)
    w8a16 on CPU, float32 -> `W8A16Linear` (int8 GEMV for decode steps; path by the CPU's features)
    otherwise (w4a16, asymmetric, grouped w8a16)
                  -> a float nn.Linear holding the dequantised weight (packed for oneDNN on CPU)

Fused q/k/v with static activations take the largest of their three input scales (as vLLM does;
`tessel quantize` writes equal ones, q/k/v reading the same tensor).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tessel.errors import TesselError
from tessel.layers.linear import W8A8Linear, W8A16Linear, dequantized_linear
from tessel.models.quantized.compressed_tensors import read_module
from tessel.models.quantized.schemes import QuantizedWeight, Scheme

# tessel module -> the checkpoint linears it fuses, in order
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
QUANTIZED_LEAVES = frozenset(leaf.rsplit(".", 1)[-1] for parts in FUSED.values() for leaf in parts)


def is_quantized_tensor(name: str) -> bool:
    """Tensors of the decoder layers' linears, which `load_linears` reads instead of the loader."""
    parts = name.split(".")
    return name.startswith("model.layers.") and len(parts) >= 3 and parts[-2] in QUANTIZED_LEAVES


def drop_linears(model: nn.Module) -> None:
    """Replace each decoder-layer linear by an empty placeholder (before the model's memory is allocated)."""
    for layer in model.model.layers:
        for target in FUSED:
            parent, leaf = _parent(layer, target)
            setattr(parent, leaf, nn.Identity())


def _parent(layer: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    owner, leaf = dotted.split(".")
    return getattr(layer, owner), leaf


class _Tensors:
    """Lazy access to a checkpoint's tensors by name, over all its safetensors files."""

    def __init__(self, files: list[Path]) -> None:
        self.handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self.where = {name: h for h in self.handles for name in h.keys()}

    def get(self, name: str) -> torch.Tensor:
        handle = self.where.get(name)
        if handle is None:
            raise TesselError(f"the quantised checkpoint lacks tensor {name!r}")
        return handle.get_tensor(name)

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self.where else None


def load_linears(model: nn.Module, files: list[Path], scheme: Scheme, dtype: torch.dtype, device) -> None:
    """Build every decoder-layer linear from the checkpoint's quantised tensors."""
    tensors = _Tensors(files)
    for i, layer in enumerate(model.model.layers):
        for target, parts in FUSED.items():
            prefixes = [f"model.layers.{i}.{part}" for part in parts]
            weights, input_scales, biases = [], [], []
            for prefix in prefixes:
                weight, input_scale = read_module(tensors.get, prefix, scheme)
                weights.append(weight)
                input_scales.append(input_scale)
                biases.append(tensors.maybe(f"{prefix}.bias"))
            module = _build(scheme, weights, input_scales, biases, dtype, device)
            parent, leaf = _parent(layer, target)
            setattr(parent, leaf, module)


def _cat_bias(biases: list[torch.Tensor | None], weights: list[QuantizedWeight]) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [
            b.float() if b is not None else torch.zeros(w.q.shape[0])
            for b, w in zip(biases, weights, strict=True)
        ]
    )


def _build(scheme: Scheme, weights, input_scales, biases, dtype, device) -> nn.Module:
    bias = _cat_bias(biases, weights)
    q = torch.cat([w.q for w in weights])
    scale = torch.cat([w.scale for w in weights])
    if not scheme.weight_only:
        if scheme.group_size is not None:
            raise TesselError(
                "quantization_config: w8a8 with grouped weights is not supported; use strategy 'channel'"
            )
        input_scale = torch.stack(input_scales).max() if scheme.act_static else None
        return W8A8Linear(q.to(device), scale.to(device), _to(bias, device), _to(input_scale, device))
    per_channel_int8 = scheme.weight_bits == 8 and scheme.group_size is None and scheme.symmetric
    if per_channel_int8 and torch.device(device).type == "cuda":
        return W8A16Linear(q.to(device), scale.reshape(-1).to(device), _to(bias, device))
    if per_channel_int8 and torch.device(device).type == "cpu" and dtype == torch.float32:
        return W8A16Linear(q, scale.reshape(-1), bias)
    zero_point = None if scheme.symmetric else torch.cat([w.zero_point for w in weights])
    weight = QuantizedWeight(q, scale, scheme.group_size, zero_point).dequantize()
    return dequantized_linear(weight.to(device), _to(bias, device), dtype)


def _to(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)
