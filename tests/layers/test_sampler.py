"""Sampler: greedy, top-k / top-p masks against a brute force, the sampled distribution, seeds."""

from __future__ import annotations

import pytest
import torch

from tessel.layers.sampler import Sampler, apply_top_k_top_p


def brute_force_keep(logits: torch.Tensor, k: int, p: float) -> set[int]:
    """HF's rule: top-k first, then the smallest most-likely set whose mass reaches p."""
    order = sorted(range(len(logits)), key=lambda i: -float(logits[i]))
    if k > 0:
        order = order[:k]
    probs = torch.softmax(logits[order], dim=0).tolist()
    keep, mass = [], 0.0
    for i, prob in zip(order, probs, strict=True):
        keep.append(i)
        mass += prob
        if mass >= p:
            break
    return set(keep)


@pytest.mark.parametrize("vocab", [1, 7, 50])
@pytest.mark.parametrize("k, p", [(0, 1.0), (1, 1.0), (3, 1.0), (0, 0.5), (5, 0.9), (0, 0.999), (100, 0.3)])
def test_top_k_top_p_mask_matches_brute_force(vocab: int, k: int, p: float) -> None:
    g = torch.Generator().manual_seed(vocab * 31 + k)
    logits = torch.randn(4, vocab, generator=g, dtype=torch.float64).float() * 3
    masked = apply_top_k_top_p(logits, torch.full((4,), k), torch.full((4,), p))
    for row in range(4):
        kept = {i for i in range(vocab) if masked[row, i] > float("-inf")}
        assert kept == brute_force_keep(logits[row], k, p)
        assert torch.equal(masked[row][list(kept)], logits[row][list(kept)])


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(6, 40)
    out = Sampler()(logits, torch.zeros(6), torch.zeros(6, dtype=torch.long), torch.ones(6))
    assert torch.equal(out, logits.argmax(-1))


def test_sampled_frequencies_follow_softmax_with_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9.0]])
    temperature, n = 0.7, 40_000
    gen = torch.Generator().manual_seed(0)
    batch = logits.expand(n, -1).contiguous()
    draws = Sampler()(batch, torch.full((n,), temperature), None, None, [gen] + [None] * (n - 1))
    freq = torch.bincount(draws, minlength=5).float() / n
    expected = torch.softmax(logits[0] / temperature, dim=0)
    assert torch.allclose(freq, expected, atol=0.01), (freq, expected)


def test_top_k_and_top_p_never_sample_outside_the_kept_set() -> None:
    logits = torch.randn(2000, 30, generator=torch.Generator().manual_seed(2))
    k = torch.randint(0, 6, (2000,))
    p = torch.rand(2000) * 0.9 + 0.05
    draws = Sampler()(logits, torch.ones(2000), k, p)
    for row in range(0, 2000, 97):
        assert int(draws[row]) in brute_force_keep(logits[row], int(k[row]), float(p[row]))


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(3))
    temps = torch.ones(5)

    def run(order: list[int]) -> dict[int, list[int]]:
        gens = {i: torch.Generator().manual_seed(100 + i) for i in (1, 3)}
        seen: dict[int, list[int]] = {1: [], 3: []}
        for _ in range(20):
            rows = logits[order]
            out = Sampler()(rows, temps[: len(order)], None, None, [gens.get(i) for i in order])
            for pos, i in enumerate(order):
                if i in seen:
                    seen[i].append(int(out[pos]))
        return seen

    assert run([0, 1, 2, 3, 4]) == run([3, 4, 1]) == run([1, 3])
