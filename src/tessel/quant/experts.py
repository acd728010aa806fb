"""transformers' stacked experts as one `gate_proj` / `up_proj` / `down_proj` nn.Linear per expert.

transformers 5 holds an MoE layer's experts as two 3-D parameters (`gate_up_proj` [E, 2F, H],
`down_proj` [E, H, F]). The quantiser rounds each expert on its own (its own scales; GPTQ's Hessian
and a static observer see only the rows routed to it), so before calibrating it swaps each such
module for `ExpertLinears`, which computes the same function from per-expert linears the hooks and
`tessel.quant.layer_map` can name (`mlp.experts.{e}.gate_proj`).
"""

from __future__ import annotations

import torch
from torch import nn


class _Expert(nn.Module):
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn: nn.Module) -> None:
        super().__init__()
        self.act_fn = act_fn
        width, hidden = gate_up.shape[0] // 2, gate_up.shape[1]
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        with torch.no_grad():
            self.gate_proj.weight.copy_(gate_up[:width])
            self.up_proj.weight.copy_(gate_up[width:])
            self.down_proj.weight.copy_(down)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(rows)) * self.up_proj(rows))


class ExpertLinears(nn.ModuleList):
    """`forward(x [T, H], top_k_index [T, k], top_k_weights [T, k])` as transformers' experts compute it."""

    def __init__(self, stacked: nn.Module) -> None:
        super().__init__(
            _Expert(stacked.gate_up_proj[e].detach(), stacked.down_proj[e].detach(), stacked.act_fn)
            for e in range(stacked.gate_up_proj.shape[0])
        )

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(x[token]) * top_k_weights[token, slot, None])
        return out


def unstack_experts(model: nn.Module) -> int:
    """Swap every stacked-experts module of `model` for `ExpertLinears` in place; -> how many."""
    swapped = 0
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and isinstance(getattr(experts, "gate_up_proj", None), nn.Parameter):
            layer.mlp.experts = ExpertLinears(experts)
            swapped += 1
    return swapped
