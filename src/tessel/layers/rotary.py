"""Rotary position embedding with Llama 3 and linear scaling, on `tessel.rope`.

The cos/sin tables ([max_position, rotary_dim / 2], float32) are computed once, the way HF
`LlamaRotaryEmbedding` computes them, so the rotated q/k match HF to the bit in float32.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tessel.catalog.hf_config import ROPE_TYPES, RopeScaling
from tessel.kernels import rope
from tessel.kernels.rope import rope_rotate, rope_tables

__all__ = ["ROPE_TYPES", "RopeScaling", "RotaryEmbedding", "inverse_frequencies"]


def inverse_frequencies(rotary_dim: int, base: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """inv_freq[i] = base^(-2i / rotary_dim), then scaled as HF's `ROPE_INIT_FUNCTIONS` do."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """`forward(positions [T], q [T, Hq, D], k [T, Hkv, D])` -> rotated (q, k)."""

    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        base: float,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.base = base
        self.scaling = scaling
        self.cos = torch.empty(0)
        self.sin = torch.empty(0)
        # (positions, dtype) -> rope_tables of the last call: every layer of a step rotates at the
        # same positions, so the gather runs once per step, not once per layer
        self._last: tuple[torch.Tensor, torch.dtype, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.build_tables()

    def build_tables(self, device: torch.device | str = "cpu") -> None:
        """(Re)compute the cos/sin tables; call after moving the module off the meta device."""
        with torch.device(device):  # also inside a `with torch.device("meta")` model construction
            inv_freq = inverse_frequencies(self.rotary_dim, self.base, self.scaling)
            positions = torch.arange(self.max_position, dtype=torch.int64).float()
            freqs = positions[:, None] * inv_freq[None, :]
            self.cos, self.sin = freqs.cos(), freqs.sin()
        self._last = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.is_cuda or torch.is_grad_enabled():
            return rope(q, k, positions, self.cos, self.sin)
        return rope(q, k, positions, self.cos, self.sin, tables=self._tables(positions, q.dtype))

    def rotate_qk(
        self,
        positions: torch.Tensor | None,
        qk: torch.Tensor,
        num_q_heads: int,
        tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k heads side by side, qk [T, Hq + Hkv, D] (a view of the fused qkv output) -> rotated
        (q, k) views. On the PyTorch path one rotation covers both (half the ops of `forward`, the
        same products and sums: bit-equal); `tables`: the positions' `rope_tables`, where the caller
        has them (the compiled CPU decode step passes them in, `positions` None)."""
        if tables is None and (qk.is_cuda or torch.is_grad_enabled()):
            return self(positions, qk[:, :num_q_heads], qk[:, num_q_heads:])
        out = rope_rotate(qk, self._tables(positions, qk.dtype) if tables is None else tables)
        return out[:, :num_q_heads], out[:, num_q_heads:]

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        last = self._last
        if last is None or last[0] is not positions or last[1] != dtype:
            last = self._last = (positions, dtype, rope_tables(positions, self.cos, self.sin, dtype))
        return last[2]
