"""Outputs built when read (issue 47): a request without stop strings is detokenized only when its
text is read, and its token ids sliced then. The oracle is the engine decoding every token as it
comes (the detokenizer's eager path, itself held against the tokenizer's whole decode in
test_detokenizer.py): the same texts and deltas at every step, in whatever order they are read."""

from __future__ import annotations

import functools
import pickle
import random

import pytest
import torch

from tessel import LLM, SamplingParams
from tessel.engine import llm_engine
from tessel.engine.detokenizer import IncrementalDetokenizer
from tessel.engine.model_runner import greedy_tokens

FIELDS = ("request_id", "token_ids", "new_token_ids", "text", "new_text", "finished", "finish_reason")


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return LLM(checkpoints("llama"), max_model_len=128, block_size=4)


def run(llm: LLM, seed: int, read_backwards: bool) -> dict[str, list[tuple]]:
    """Random requests (some with stop strings, some sampled, one aborted midway) stepped to the
    end; -> each request's outputs' fields in order, read after the run (backwards: the latest
    first). Per request: a second run's prompts hit the prefix cache, which reorders a step."""
    rng = random.Random(seed)
    for i in range(6):
        prompt = [rng.randrange(5, 300) for _ in range(rng.randint(1, 12))]
        stop = ["e", "th"] if i % 3 == 2 else []
        temperature = 0.0 if i % 2 else 0.8
        params = SamplingParams(temperature=temperature, seed=i, max_tokens=rng.randint(1, 30), stop=stop)
        llm.add_request(f"lazy-{seed}-{i}", prompt, params)
    outputs = []
    steps = 0
    while llm.has_unfinished_requests():
        outputs += llm.step()
        steps += 1
        if steps == 4:
            llm.abort_request(f"lazy-{seed}-1")
    order = reversed(outputs) if read_backwards else outputs
    read = {id(out): tuple(getattr(out, name) for name in FIELDS) for out in order}
    found: dict[str, list[tuple]] = {}
    for out in outputs:
        found.setdefault(out.request_id, []).append(read[id(out)])
    return found


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outputs_read_late_equal_the_eagerly_decoded_ones(llm, monkeypatch, seed):
    lazy = run(llm, seed, read_backwards=True)
    assert lazy == run(llm, seed, read_backwards=False)
    eager = functools.partial(IncrementalDetokenizer, may_defer=False)
    monkeypatch.setattr(llm_engine, "IncrementalDetokenizer", lambda *args, **kw: eager(*args))
    assert run(llm, seed, read_backwards=False) == lazy


def test_a_resolved_output_pickles_and_equals_its_copy(llm):
    llm.add_request("pickled", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    for out in outputs:
        copy = pickle.loads(pickle.dumps(out))
        assert copy == out and copy.text == out.text and copy.token_ids == out.token_ids
        assert out.resolve() is out and repr(out).startswith("RequestOutput(request_id='pickled'")


def test_greedy_tokens_are_torch_argmax_with_ties_and_infinities():
    generator = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 1), (5, 123), (64, 384)):
        logits = torch.randint(-3, 3, (rows, vocab), generator=generator).float()  # many ties
        logits[0, : vocab // 2] = float("-inf")
        if rows > 1:
            logits[1] = float("-inf")
        assert greedy_tokens(logits) == logits.argmax(dim=-1).tolist()
