"""RMSNorm on `tessel.rms_norm`, with the residual add fused in (HF Llama convention)."""

from __future__ import annotations

import torch
from torch import nn

from tessel.kernels import rms_norm


class RMSNorm(nn.Module):
    """`forward(x)` -> norm(x); `forward(x, residual)` -> (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)
