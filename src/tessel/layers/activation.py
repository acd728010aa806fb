"""The gated MLP's activations: SwiGLU on `tessel.silu_and_mul`, Gemma's GeGLU (tanh GELU) in PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessel.kernels import silu_and_mul


class SiluAndMul(nn.Module):
    """x = [gate | up] (last dim 2F) -> silu(gate) * up (last dim F)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """x = [gate | up] (last dim 2F) -> gelu_tanh(gate) * up (last dim F): HF's `gelu_pytorch_tanh`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def gated_activation(name: str) -> nn.Module:
    """The gate of a `hidden_act` the config reader accepted (`tessel.models.config.ACTIVATIONS`)."""
    return GeluTanhAndMul() if name == "gelu_pytorch_tanh" else SiluAndMul()
