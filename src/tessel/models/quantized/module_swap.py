"""Run a compressed-tensors checkpoint in the engine: swap the model's linears for quantised ones.

gpt-fast style: the model is built as usual (on the meta device), its decoder-layer linears are
replaced by placeholders before memory is allocated, the float tensors load as usual, then each
linear is rebuilt from the checkpoint's quantised tensors (q/k/v and gate/up concatenated into
tessel's fused `qkv_proj` / `gate_up_proj`; Phi-3's stored fused; each MoE expert's gate/up and down
as one pair of modules, `ExpertMLPs.use_linears`; the routers stay float tensors the loader fills):

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
from tessel.models.config import ModelConfig
from tessel.models.quantized.compressed_tensors import read_module
from tessel.models.quantized.schemes import QuantizedWeight, Scheme

# tessel module -> the checkpoint linears it fuses, in order (Llama's names; `layer_targets` adapts them)
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
# an expert's gate, up, down in the checkpoint (others: gate_proj, up_proj, down_proj)
EXPERT_LEAVES = {"MixtralForCausalLM": ("w1", "w3", "w2")}
QUANTIZED_LEAVES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj"}
    | {"w1", "w2", "w3"}
)


def is_quantized_tensor(name: str) -> bool:
    """Tensors of the decoder layers' linears, which `load_linears` reads instead of the loader."""
    parts = name.split(".")
    return name.startswith("model.layers.") and len(parts) >= 3 and parts[-2] in QUANTIZED_LEAVES


def _mlp_targets(prefix: str, fused: bool) -> dict[str, tuple[str, ...]]:
    gate_up = (f"{prefix}.gate_up_proj",) if fused else (f"{prefix}.gate_proj", f"{prefix}.up_proj")
    return {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": (f"{prefix}.down_proj",)}


def layer_targets(config: ModelConfig, index: int) -> dict[str, tuple[str, ...]]:
    """Layer `index`'s quantised tessel modules -> the checkpoint linears each fuses (not the experts:
    `expert_targets`). Phi-3 stores qkv_proj and gate_up_proj fused already."""
    fused = config.fused_checkpoint
    qkv = ("self_attn.qkv_proj",) if fused else FUSED["self_attn.qkv_proj"]
    out = {"self_attn.qkv_proj": qkv, "self_attn.o_proj": ("self_attn.o_proj",)}
    if not config.is_moe_layer(index):
        return out | _mlp_targets("mlp", fused)
    if config.shared_expert_intermediate_size:
        out |= _mlp_targets("mlp.shared_expert", fused)
    return out


def expert_targets(config: ModelConfig, index: int) -> list[tuple[tuple[str, str], tuple[str]]]:
    """Per expert of MoE layer `index`: ((gate, up), (down,)) checkpoint linears ([] for a dense layer)."""
    if not config.is_moe_layer(index):
        return []
    block = "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"
    gate, up, down = EXPERT_LEAVES.get(config.architecture, ("gate_proj", "up_proj", "down_proj"))
    prefix = f"{block}.experts"
    return [
        ((f"{prefix}.{e}.{gate}", f"{prefix}.{e}.{up}"), (f"{prefix}.{e}.{down}",))
        for e in range(config.num_experts)
    ]


def drop_linears(model: nn.Module) -> None:
    """Replace each decoder-layer linear by an empty placeholder, and forget the stacked expert weights
    (before the model's memory is allocated)."""
    for index, layer in enumerate(model.model.layers):
        for target in layer_targets(model.config, index):
            parent, leaf = _parent(layer, target)
            setattr(parent, leaf, nn.Identity())
        if expert_targets(model.config, index):
            layer.mlp.experts.drop_weights()


def _parent(layer: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    owner, leaf = dotted.rsplit(".", 1)
    return layer.get_submodule(owner), leaf


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
    """Build every decoder-layer linear (and each expert's pair) from the checkpoint's quantised tensors."""
    tensors = _Tensors(files)

    def build(index: int, parts: tuple[str, ...]) -> nn.Module:
        prefixes = [f"model.layers.{index}.{part}" for part in parts]
        kept = [p in scheme.float_linears for p in prefixes]
        if any(kept):
            if not all(kept):
                raise TesselError(f"quantization_config.ignore keeps some of {prefixes} float, not all")
            return _float(tensors, prefixes, dtype, device)
        weights, input_scales, biases = [], [], []
        for prefix in prefixes:
            weight, input_scale = read_module(tensors.get, prefix, scheme)
            weights.append(weight)
            input_scales.append(input_scale)
            biases.append(tensors.maybe(f"{prefix}.bias"))
        return _build(scheme, weights, input_scales, biases, dtype, device)

    for i, layer in enumerate(model.model.layers):
        for target, parts in layer_targets(model.config, i).items():
            parent, leaf = _parent(layer, target)
            setattr(parent, leaf, build(i, parts))
        experts = expert_targets(model.config, i)
        if experts:
            layer.mlp.experts.use_linears([(build(i, gate_up), build(i, down)) for gate_up, down in experts])


def _float(tensors: _Tensors, prefixes: list[str], dtype: torch.dtype, device) -> nn.Module:
    """A float linear of the checkpoint's float weights (linears `ignore` names), fused in order."""
    weights = [tensors.get(f"{p}.weight").float() for p in prefixes]
    biases = [tensors.maybe(f"{p}.bias") for p in prefixes]
    bias = None
    if any(b is not None for b in biases):
        pairs = zip(biases, weights, strict=True)
        bias = torch.cat([b.float() if b is not None else torch.zeros(w.shape[0]) for b, w in pairs])
    weight = torch.cat(weights)
    return dequantized_linear(weight.to(device), _to(bias, device), dtype)


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
