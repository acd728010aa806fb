"""The incremental detokenizer against the tokenizer's own whole-text decode (the oracle), on its
two paths: the Rust `DecodeStream` (fast tokenizers) and the Python-side window (any tokenizer)."""

from __future__ import annotations

import itertools
import random

import pytest

from tessel.engine import detokenizer
from tessel.engine.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer

TEXTS = [
    "Hello there, naïve café — 日本語のテキスト ✓ okay. Ünïcödé 🙂 emoji and CJK 漢字.",
    "  leading spaces, tabs\tand\nnewlines\n\n  kept",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def _streamed(tokenizer, prompt: list[int], output: list[int], stop: list[str]) -> tuple[list[str], str]:
    """Each step's visible text, and the final text after `finish`."""
    detok = IncrementalDetokenizer(tokenizer, prompt, stop)
    seen = []
    for token in output:
        stopped = detok.add_token(token)
        seen.append(detok.text)
        if stopped is not None:
            break
    detok.finish()
    return seen, detok.text


def _oracle(tokenizer, prompt: list[int], output: list[int]) -> str:
    context = prompt[-PROMPT_CONTEXT_TOKENS:]
    whole = tokenizer.decode(context + output, skip_special_tokens=True)
    return whole[len(tokenizer.decode(context, skip_special_tokens=True)) :]


@pytest.mark.parametrize("text", TEXTS)
def test_the_streamed_text_is_the_whole_decode(tokenizer, text):
    ids = tokenizer.encode("The prompt says: " + text)
    prompt, output = ids[:5], ids[5:]
    seen, final = _streamed(tokenizer, prompt, output, [])
    assert final == _oracle(tokenizer, prompt, output)
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(seen))  # only appended
    assert "\ufffd" not in "".join(seen)  # a character split across tokens waits for its last byte


def test_both_paths_agree_step_by_step_on_random_tokens(tokenizer, monkeypatch):
    """Random ids (half of them byte tokens that make broken UTF-8) and stop strings: the stream and
    the window show the same text at every step."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    for trial in range(20):
        prompt = [rng.randrange(vocab) for _ in range(6)]
        output = [rng.randrange(300) if rng.random() < 0.5 else rng.randrange(vocab) for _ in range(40)]
        stop = ["e t", "\n"] if trial % 2 else []
        fast = _streamed(tokenizer, prompt, output, stop)
        with monkeypatch.context() as patched:
            patched.setattr(detokenizer, "DecodeStream", None)
            assert IncrementalDetokenizer(tokenizer, prompt, [])._stream is None
            window = _streamed(tokenizer, prompt, output, stop)
        assert fast == window, trial
        if not stop:
            assert fast[1] == _oracle(tokenizer, prompt, output)


def test_a_fast_tokenizer_takes_the_stream(tokenizer):
    assert IncrementalDetokenizer(tokenizer, [1, 2, 3], [])._stream is not None
