"""logprobs and echo through the official `openai` client, against HF transformers (issue 15).

The server runs once per engine kind (conftest: one process; a 2-stage pipeline as `serve --plan`
runs it, issue 27; the router of a 2-replica plan, issue 29); prompt (echo) and completion logprobs
must equal HF's log-softmax of its logits over the same tokens to 1e-4, in the shapes the client
parses, and the single-process engine's (`LLM.generate`) to float rounding; streamed logprobs must
equal the non-streamed ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

openai = pytest.importorskip("openai")

TOL = 1e-4
PROMPT = "Once upon a time there was a small model"


@pytest.fixture(scope="module")
def engine(make_engine: Any) -> Any:
    with make_engine(max_num_seqs=4, max_model_len=256, kv_cache_gib=0.01) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(engine: Any, serve_engine: Any) -> Any:
    with serve_engine(engine, max_pending=8) as served:
        yield openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=60.0)


@pytest.fixture(scope="module")
def hf(tiny_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double().log_softmax(dim=-1)

    return logprobs


def test_completion_echo_logprobs_equal_hf(client: Any, engine: Any, hf: Any, tiny_model: Path) -> None:
    prompt_ids = list(engine.tokenizer(PROMPT).input_ids)
    result = client.completions.create(
        model=tiny_model.name, prompt=PROMPT, max_tokens=5, temperature=0.9, seed=3, echo=True, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = result.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    n = len(prompt_ids) + result.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    # the sampled tokens: the same seed through `LLM.generate` gives the same ones (the server's oracle)
    from tessel import LLM, SamplingParams

    oracle = LLM(str(tiny_model), max_model_len=256, kv_cache_gib=0.01)
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=5, ignore_eos=True)
    ids = prompt_ids + oracle.generate(PROMPT, params)[0].token_ids
    assert choice.text == PROMPT + oracle.generate(PROMPT, params)[0].text
    expected = hf(ids)
    for pos in range(1, n):
        assert lp.token_logprobs[pos] == pytest.approx(expected[pos - 1, ids[pos]].item(), abs=TOL)
        # keyed by token text, so ids with the same text (bytes of one character) share a key
        allowed = expected[pos - 1].topk(3).values.tolist() + [expected[pos - 1, ids[pos]].item()]
        assert 1 <= len(lp.top_logprobs[pos]) <= 4
        for value in lp.top_logprobs[pos].values():
            assert min(abs(value - a) for a in allowed) < TOL


def test_prompt_logprobs_of_token_ids_equal_hf(client: Any, engine: Any, hf: Any, tiny_model: Path) -> None:
    """Token-id prompts: no re-tokenizing, so every prompt position is checked."""
    prompt_ids = list(engine.tokenizer(PROMPT + " and another one").input_ids)
    result = client.completions.create(
        model=tiny_model.name, prompt=prompt_ids, max_tokens=1, echo=True, logprobs=0, temperature=0
    )
    lp = result.choices[0].logprobs
    expected = hf(prompt_ids)
    got = lp.token_logprobs[1 : len(prompt_ids)]
    want = [expected[pos - 1, prompt_ids[pos]].item() for pos in range(1, len(prompt_ids))]
    assert got == pytest.approx(want, abs=TOL)


def test_chat_logprobs_streamed_equal_non_streamed(client: Any, tiny_model: Path) -> None:
    kw = dict(
        model=tiny_model.name, messages=[{"role": "user", "content": "Say hello"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=4,
    )  # fmt: skip
    full = client.chat.completions.create(**kw).choices[0]
    content = full.logprobs.content
    assert len(content) == 6 or full.finish_reason == "stop"
    for item in content:
        assert len(item.top_logprobs) == 4
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=TOL)  # greedy: the top one
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    streamed = [
        item for chunk in client.chat.completions.create(**kw, stream=True)
        for choice in chunk.choices if choice.logprobs is not None for item in choice.logprobs.content
    ]  # fmt: skip
    assert [(i.token, round(i.logprob, 5)) for i in streamed] == [
        (i.token, round(i.logprob, 5)) for i in content
    ]


def test_streamed_completion_logprobs_equal_non_streamed(client: Any, tiny_model: Path) -> None:
    kw = dict(model=tiny_model.name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True)
    full = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [
        o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    assert text == full.text
    assert tokens == full.logprobs.tokens and offsets == full.logprobs.text_offset


@pytest.mark.single_engine
def test_logprobs_bounds_are_400(client: Any, tiny_model: Path) -> None:
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=tiny_model.name, prompt="hi", logprobs=21)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(
            model=tiny_model.name, messages=[{"role": "user", "content": "hi"}], top_logprobs=3
        )


def test_logprobs_equal_the_single_process_engine(client: Any, engine: Any, tiny_model: Path) -> None:
    """The response's logprobs, echoed prompt and alternatives included, are those of the
    single-process engine (`LLM.generate` with the same sampling, shaped by the server's own
    `completion_logprobs`) to float rounding; greedy and seeded."""
    from tessel import LLM, SamplingParams
    from tessel.server.logprobs import TokenText, completion_logprobs

    oracle = LLM(str(tiny_model), max_model_len=256, kv_cache_gib=0.01)
    for temperature, seed in [(0.0, None), (0.8, 11)]:
        result = client.completions.create(
            model=tiny_model.name, prompt=PROMPT, max_tokens=6, temperature=temperature, seed=seed,
            echo=True, logprobs=3, extra_body={"ignore_eos": True},
        )  # fmt: skip
        params = SamplingParams(
            temperature=temperature, seed=seed, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3
        )
        out = oracle.generate(PROMPT, params, use_progress=False)[0]
        ids = out.prompt_token_ids + out.token_ids
        want = completion_logprobs(out.prompt_logprobs + out.logprobs, TokenText(oracle.tokenizer), ids)
        got = result.choices[0].logprobs
        assert result.choices[0].text == PROMPT + out.text
        assert got.tokens == want.tokens and got.text_offset == want.text_offset
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
        assert got.token_logprobs[1:] == pytest.approx(want.token_logprobs[1:], abs=1e-5)
        for top, expected in zip(got.top_logprobs[1:], want.top_logprobs[1:], strict=True):
            assert top == pytest.approx(expected, abs=1e-5)
