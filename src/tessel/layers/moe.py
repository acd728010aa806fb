"""Routed experts of a mixture-of-experts MLP: router softmax, top-k, and a grouped expert path.

`ExpertMLPs` holds every expert's gated MLP as two stacked weights (`gate_up_proj` [E, 2F, H],
`down_proj` [E, H, F]). A step's T tokens pick k experts each; the T*k (token, expert) pairs are
sorted by expert, so each expert runs one GEMM over the rows routed to it (a Python loop over the
experts that got rows, never over tokens), and the weighted rows are summed back into their tokens
with one `index_add_` in expert order, as transformers sums them. On the CPU `pack()` (called by
`tessel.layers.linear.pack_linears` with the model's linears) moves each expert's two weights into
oneDNN's layout, as the dense linears are: about twice as fast for the few rows an expert gets in a
decode step. A quantised checkpoint's experts run as one quantised module pair per expert
(`use_linears`, built by `tessel.models.quantized.module_swap`) on the same grouped path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessel.layers.activation import gated_activation
from tessel.layers.linear.dense import PackedWeight, onednn_weight


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, experts [T, k]): softmax in
    float32 over all experts, the k largest, renormalised to sum to 1 when `renormalise`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


class ExpertMLPs(nn.Module):
    """`forward(x [T, H], weights [T, k], experts [T, k])` -> sum_k weight * expert_k(x) [T, H]."""

    packs_with_linears = True  # `pack_linears` packs it (it cannot import this module)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = gated_activation(act)
        self.packed: list[tuple[PackedWeight, PackedWeight]] | None = None
        self.linears: nn.ModuleList | None = None  # quantised experts: (gate_up, down) modules per expert

    def drop_weights(self) -> None:
        """Forget the stacked weights (before allocation): a quantised checkpoint's experts come as
        modules (`use_linears`)."""
        self.gate_up_proj = None
        self.down_proj = None

    def use_linears(self, experts: list[tuple[nn.Module, nn.Module]]) -> None:
        """Run expert e as `down(act(gate_up(rows)))` with the given modules (a quantised checkpoint's)."""
        self.linears = nn.ModuleList(nn.ModuleList(pair) for pair in experts)

    def pack(self) -> None:
        """Each expert's gate/up and down weights in oneDNN's layout (float32 on the CPU); the stacked
        weights are freed."""
        self.packed = [
            (
                PackedWeight(onednn_weight(self.gate_up_proj[e]), None),
                PackedWeight(onednn_weight(self.down_proj[e]), None),
            )
            for e in range(self.num_experts)
        ]
        self.gate_up_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(0), requires_grad=False)

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        if self.linears is not None:
            gate_up, down = self.linears[expert]
            return down(self.act(gate_up(rows)))
        if self.packed is not None:
            gate_up, down = self.packed[expert]
            return down(self.act(gate_up(rows)))
        return F.linear(self.act(F.linear(rows, self.gate_up_proj[expert])), self.down_proj[expert])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        top_k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order within
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // top_k
        rows = x.index_select(0, tokens)
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                out[start : start + count] = self._expert(expert, rows[start : start + count])
                start += count
        out *= weights.reshape(-1, 1).index_select(0, order)
        return torch.zeros_like(x).index_add_(0, tokens, out)
