"""Logprobs of generated and prompt tokens against HF transformers' logits (issue 15).

Values are log-softmax of the raw logits (before temperature / top-k / top-p), so a sampled run at
temperature 0.7 is compared with HF's teacher-forced logits over prompt + generated tokens, to 1e-4,
with chunked prefill cutting the prompt and with the prefix cache holding it.
"""

from __future__ import annotations

import pytest
import torch

from tessel import LLM, SamplingParams, TesselError

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time there was a small model"
TOL = 1e-4


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="module")
def hf_logprobs(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double().log_softmax(dim=-1)

    return logprobs


def _check(out, hf, k_out: int, k_prompt: int) -> None:
    ids = out.prompt_token_ids + out.token_ids
    expected = hf(ids)
    num_prompt = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == num_prompt
    for pos in range(1, num_prompt):
        got = out.prompt_logprobs[pos]
        assert got.token_id == ids[pos]
        assert got.logprob == pytest.approx(expected[pos - 1, ids[pos]].item(), abs=TOL)
        values, indices = expected[pos - 1].topk(k_prompt)
        assert [v for _, v in got.top] == pytest.approx(values.tolist(), abs=TOL)
        assert [i for i, _ in got.top] == indices.tolist()
    assert len(out.logprobs) == len(out.token_ids)
    for j, got in enumerate(out.logprobs):
        row = expected[num_prompt + j - 1]
        assert got.token_id == out.token_ids[j]
        assert got.logprob == pytest.approx(row[got.token_id].item(), abs=TOL)
        values, _ = row.topk(k_out)
        assert [v for _, v in got.top] == pytest.approx(values.tolist(), abs=TOL)


def test_logprobs_equal_hf_log_softmax(path, hf_logprobs) -> None:
    llm = LLM(path, max_model_len=128, block_size=4)
    params = SamplingParams(
        temperature=0.7, seed=5, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=3
    )
    first = llm.generate(PROMPT, params)[0]
    _check(first, hf_logprobs, 5, 3)
    again = llm.generate(PROMPT, params)[0]  # the prompt's blocks are cached: still computed for logprobs
    assert again.prompt_logprobs == first.prompt_logprobs and again.token_ids == first.token_ids


def test_prompt_logprobs_across_prefill_chunks(path, hf_logprobs) -> None:
    llm = LLM(path, max_model_len=128, block_size=4, max_num_batched_tokens=7)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0, prompt_logprobs=2)
    outs = llm.generate([PROMPT, PROMPT[:30]], params)
    for out in outs:
        _check(out, hf_logprobs, 0, 2)
        assert all(not lp.top for lp in out.logprobs)


def test_no_logprobs_unless_asked_and_bounds(path) -> None:
    llm = LLM(path, max_model_len=64)
    out = llm.generate("hi", SamplingParams(max_tokens=2))[0]
    assert out.logprobs is None and out.prompt_logprobs is None
    for bad in (21, -1, 1.5, True):
        with pytest.raises(TesselError, match="logprobs"):
            SamplingParams(logprobs=bad)
