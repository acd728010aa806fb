"""The SwiGLU gate on `tessel.silu_and_mul`."""

from __future__ import annotations

import torch
from torch import nn

from tessel.kernels import silu_and_mul


class SiluAndMul(nn.Module):
    """x = [gate | up] (last dim 2F) -> silu(gate) * up (last dim F)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
