"""Checkpoint (Hugging Face) tensor names -> the parameters of `tessel.models.llama` that hold them.

    param, shard = parameter_of("model.layers.0.self_attn.k_proj.weight", config)
                                                 # ("model.layers.0.self_attn.qkv_proj.weight", 1)
    view = shard_view(param, tensor, shard, config)  # where that checkpoint tensor is copied

A parameter is filled whole (shard None) or in shards: q/k/v into the fused `qkv_proj` (0, 1, 2),
gate/up into `gate_up_proj` (0, 1); expert e's gate/up/down of an MoE layer into the stacked
`mlp.experts.gate_up_proj` ((e, 0), (e, 1)) and `mlp.experts.down_proj` ((e, None)). Mixtral's
`block_sparse_moe.experts.e.w1/w3/w2` are gate/up/down and its block is the layer's `mlp`. Phi-3
stores qkv_proj and gate_up_proj fused already: they load whole. `shards_of(param)` lists what a
parameter needs, so the loader can tell what the checkpoint lacks.
"""

from __future__ import annotations

import re
from collections.abc import Hashable

import torch

from tessel.models.config import ModelConfig

PACKED = {  # HF name fragment -> (tessel fragment, shard)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
EXPERT_PROJ = {  # an expert's projection -> (stacked parameter, shard within the expert)
    "gate_proj": ("gate_up_proj", 0),
    "w1": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "w3": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w2": ("down_proj", None),
}
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def parameter_of(name: str, config: ModelConfig) -> tuple[str, Hashable]:
    """(tessel parameter name, shard) of checkpoint tensor `name`."""
    expert = _EXPERT.match(name)
    if expert and expert.group(3) in EXPERT_PROJ:
        stacked, part = EXPERT_PROJ[expert.group(3)]
        return f"{expert.group(1)}.mlp.experts.{stacked}", (int(expert.group(2)), part)
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if config.fused_checkpoint:
        return name, None
    for fragment, (fused, shard) in PACKED.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard
    return name, None


def shards_of(param: str, config: ModelConfig) -> list[Hashable]:
    """The shards that fill parameter `param` ([None]: one tensor fills it)."""
    stacked = _STACKED.search(param)
    if stacked:
        parts = (0, 1) if stacked.group(1) == "gate_up_proj" else (None,)
        return [(e, part) for e in range(config.num_experts) for part in parts]
    if config.fused_checkpoint:
        return [None]
    if ".qkv_proj." in param:
        return [0, 1, 2]
    if ".gate_up_proj." in param:
        return [0, 1]
    return [None]


def shard_view(param: str, data: torch.Tensor, shard: Hashable, config: ModelConfig) -> torch.Tensor:
    """The part of parameter `param`'s tensor `data` that shard `shard` fills."""
    if shard is None:
        return data
    if isinstance(shard, tuple):  # (expert, part) of a stacked expert weight
        expert, part = shard
        data = data[expert]
        return data if part is None else data.narrow(0, part * (data.shape[0] // 2), data.shape[0] // 2)
    if ".qkv_proj." in param:
        sizes = [config.q_size, config.kv_size, config.kv_size]
        return data.narrow(0, sum(sizes[:shard]), sizes[shard])
    half = data.shape[0] // 2  # gate_up_proj: gate, then up
    return data.narrow(0, shard * half, half)
