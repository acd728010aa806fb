"""Token embedding and the LM head (which only projects the rows it is given), float or quantised."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden [N, H] -> float32 logits [N, V]. `tie(embedding)` shares the embedding's weight."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()


class QuantizedLMHead(nn.Module):
    """hidden [N, H] -> float32 logits [N, V] through a quantised linear (the engine's `lm_head="int8"`).
    Not an `LMHead`, so `pack_linears` leaves it alone; the embedding keeps its float weight."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden).float()
