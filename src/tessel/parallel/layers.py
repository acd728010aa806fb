"""The modules a tensor-parallel rank runs in place of the model's own where ranks must combine.

Column-parallel linears need nothing: qkv_proj and gate_up_proj are ordinary linears over the
rank's rows (its heads, its MLP columns). A row-parallel linear (o_proj, down_proj) computes its
partial sum over the rank's input columns and all-reduces it (the bias is loaded on rank 0 only).
The embedding looks up the rank's vocabulary rows, zeros elsewhere, and all-reduces; the LM head
sends the rows it projects to the followers, every rank computes its logit columns, and the leader
gathers them and samples. Each wraps the
rank's plain module (`inner`), which `pack_linears` may swap for its packed form.
"""

from __future__ import annotations

import torch
from torch import nn

from tessel.parallel.group import TPGroup
from tessel.parallel.step import LogitsCall, broadcast


class RowParallelLinear(nn.Module):
    """x [..., in / degree] -> the full output [..., out]: the rank's partial product, all-reduced."""

    def __init__(self, inner: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = [group]  # a list keeps it out of the module tree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group[0].all_reduce(self.inner(x).contiguous())


class VocabParallelEmbedding(nn.Module):
    """Token ids [T] -> [T, H]: each rank embeds the ids in its vocabulary rows, zeros the others,
    and the ranks' rows are summed (exactly one rank holds each id)."""

    def __init__(self, inner: nn.Module, vocab_start: int, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.vocab_start = vocab_start
        self.rows = inner.weight.shape[0]
        self.group = [group]

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.rows)
        hidden = self.inner(torch.where(inside, local, 0))
        hidden = hidden.masked_fill_(~inside.unsqueeze(-1), 0.0)
        return self.group[0].all_reduce(hidden)


class VocabParallelLMHead(nn.Module):
    """hidden [N, H] -> float32 logits [N, V] on the leader: it sends the rows to the followers
    (`LogitsCall`), every rank projects its vocabulary columns (`project`), the leader gathers them
    and drops the padding."""

    def __init__(self, inner: nn.Module, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.group = [group]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        broadcast(self.group[0], LogitsCall(hidden))
        return self.project(hidden)[:, : self.vocab_size]

    def project(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """This rank's logit columns, gathered: all of them on the leader, None on a follower."""
        return self.group[0].gather_to_leader(self.inner(hidden).float())


def parallelise(model: nn.Module, group: TPGroup, vocab_start: int, vocab_size: int) -> None:
    """Wrap a loaded rank's modules (the model holds the rank's slices already): row-parallel
    o_proj and down_proj, the vocabulary-parallel embedding and LM head."""
    for layer in model.model.layers:
        if isinstance(layer, nn.Identity):
            continue  # another pipeline stage's layer
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, group)
    inner = model.model
    if not isinstance(inner.embed_tokens, nn.Identity):
        inner.embed_tokens = VocabParallelEmbedding(inner.embed_tokens, vocab_start, group)
    if not isinstance(model.lm_head, nn.Identity):
        model.lm_head = VocabParallelLMHead(model.lm_head, vocab_size, group)
