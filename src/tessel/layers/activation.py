"""The SwiGLU gate on `tessel.kernels.silu_and_mul`."""

from __future__ import annotations

import torch
from torch import nn

from tessel import kernels


class SiluAndMul(nn.Module):
    """x = [gate | up] (last dim 2F) -> silu(gate) * up (last dim F)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(x)
