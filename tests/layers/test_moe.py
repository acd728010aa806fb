"""Routed experts against a per-token float64 reference: every token's k experts, weighted and summed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessel.layers.linear.dense import packing_available
from tessel.layers.moe import ExpertMLPs, route


def reference(x, gate_up, down, weights, experts) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t].tolist(), experts[t].tolist(), strict=True):
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += weight * (down[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(1, 4, 1), (7, 5, 2), (33, 8, 3), (2, 6, 6)])
@pytest.mark.parametrize("packed", [False, True])
def test_grouped_experts_match_the_per_token_sum(tokens, num_experts, top_k, packed) -> None:
    if packed and not packing_available():
        pytest.skip("no oneDNN packing in this PyTorch")
    g = torch.Generator().manual_seed(tokens * 31 + num_experts)
    hidden, width = 24, 40
    module = ExpertMLPs(num_experts, hidden, width)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(num_experts, 2 * width, hidden, generator=g) / hidden**0.5)
        module.down_proj.copy_(torch.randn(num_experts, hidden, width, generator=g) / width**0.5)
    gate_up, down = module.gate_up_proj.detach().clone(), module.down_proj.detach().clone()
    x = torch.randn(tokens, hidden, generator=g)
    weights, experts = route(torch.randn(tokens, num_experts, generator=g), top_k, renormalise=True)
    if packed:
        module.pack()
    with torch.no_grad():
        got = module(x, weights, experts)
    torch.testing.assert_close(
        got.double(), reference(x, gate_up, down, weights, experts), rtol=1e-5, atol=1e-5
    )


def test_route_takes_the_softmax_top_k_and_renormalises_only_when_asked() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probs = torch.softmax(logits, -1)
    weights, experts = route(logits, 2, renormalise=False)
    assert experts.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, probs[:, [1, 2]])
    weights, _ = route(logits, 2, renormalise=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))
