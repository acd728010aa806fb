"""HF transformers as the engine's oracle: greedy continuations and forward logits of a checkpoint."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tessel import SamplingParams

TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles",
    "Once",
    "Paged attention stores keys and values in blocks; a block table maps positions to blocks in a pool.",
    "def main(): print(",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@functools.cache
def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    return list(_hf_greedy(path, tuple(prompt_ids), max_new_tokens, ignore_eos))


@functools.cache
def _hf_greedy(
    path: Path, prompt_ids: tuple[int, ...], max_new_tokens: int, ignore_eos: bool
) -> tuple[int, ...]:
    ids = torch.tensor([prompt_ids])
    extra = {"min_new_tokens": max_new_tokens} if ignore_eos else {}
    with torch.no_grad():
        out = hf_model(path).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, **extra
        )
    return tuple(out[0, len(prompt_ids) :].tolist())


def assert_matches_hf(path: Path, outputs, max_new_tokens: int = 24) -> None:
    for out in outputs:
        expected = hf_greedy(path, out.prompt_token_ids, max_new_tokens)
        assert out.token_ids == expected, f"prompt {out.prompt!r}"
        assert out.finish_reason == ("stop" if len(expected) < max_new_tokens else "length")
