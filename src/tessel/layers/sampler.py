"""Sampling from float32 logits: greedy, temperature, top-k, top-p, per-request generators.

Rows with temperature 0 take the argmax. The others are scaled by 1/temperature, filtered by
top-k then top-p (HF's order), and sampled with the exponential-race trick
(`argmax(p / q)`, q ~ Exp(1)), which draws exactly from p. Rows with their own `torch.Generator`
draw their noise from it, so a seeded request samples the same tokens whatever else is in the
batch; the other rows share one draw from the default generator.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) logits outside each row's top-k (k <= 0: off) and top-p nucleus (p >= 1: off).

    The nucleus keeps the smallest set of most likely tokens whose probability reaches p (at least
    one token), as HF's TopPLogitsWarper does.
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab))
    # ascending order: keep the last k columns
    kth_col = (vocab - k).unsqueeze(1)
    mask = torch.arange(vocab, device=logits.device).unsqueeze(0) < kth_col
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    drop = cum <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] with the tokens each of `rows` may not take set to -inf (a new tensor).

    `bitmask` int32 [len(rows), ceil(V / 32)]: bit i of word w allows token 32w + i (llguidance's
    and xgrammar's layout). A row that allows nothing is left unmasked (the engine ends it). On the
    CPU the rows are masked in numpy, single-threaded: torch's element-wise bool ops on a few
    hundred thousand elements wait on their OpenMP workers (milliseconds on a loaded machine).
    """
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
        allowed = bits[:, :vocab].view(np.bool_)
        allowed[~allowed.any(axis=1)] = True
        picked, values = rows.numpy(), logits.numpy()
        masked = values.copy()
        masked[picked] = np.where(allowed, values[picked], np.float32("-inf"))
        return torch.from_numpy(masked)
    masked = logits.clone()
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    allowed |= ~allowed.any(dim=-1, keepdim=True)
    masked[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return masked


def exponential_noise(n: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """n draws of Exp(1) from `generator`, on the generator's device (a request's generator lives on
    the CPU, so a seeded request draws the same noise whichever device the logits are on)."""
    return torch.empty(n, dtype=dtype, device=generator.device).exponential_(generator=generator)


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
        generators: list[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        """logits [B, V] float32, temperatures [B] (0: greedy), top_k int [B], top_p [B] -> ids [B]."""
        greedy = logits.argmax(dim=-1)
        sampled_rows = (temperatures > 0).nonzero().flatten().tolist()
        if not sampled_rows:
            return greedy
        rows = torch.tensor(sampled_rows, device=logits.device)
        scaled = logits[rows] / temperatures[rows].unsqueeze(1)
        if top_k is not None and top_p is not None:
            k, p = top_k[rows], top_p[rows]
            if bool((k > 0).any()) or bool((p < 1).any()):
                scaled = apply_top_k_top_p(scaled, k, p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs)
        shared = [i for i, row in enumerate(sampled_rows) if generators is None or generators[row] is None]
        if len(shared) == len(sampled_rows):
            noise.exponential_()
        else:
            if shared:
                noise[shared] = torch.empty_like(probs[shared]).exponential_()
            for i, row in enumerate(sampled_rows):
                gen = None if generators is None else generators[row]
                if gen is not None:
                    noise[i] = exponential_noise(noise.shape[1], noise.dtype, gen)
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # 0 / 0 would be NaN, and argmax picks NaN
        greedy[rows] = (probs / noise).argmax(dim=-1)
        return greedy
