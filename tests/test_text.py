"""One check of a user's text before any tokenizer sees it (`tessel.text.check_text`, issue 42).

Every path a text takes to a tokenizer (the server's request models, the engine's and the
embedder's `tokenize`, the chat template, `tessel launch`'s request checks, the replica router's
token count, `tessel generate` and `tessel embed`) refuses a lone surrogate with the same words,
naming the character and where it is, and the tokenizer never receives it. Oracle: a tokenizer
that records every text it is handed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from typer.testing import CliRunner

from bad_text import lone_surrogate_texts
from tessel.errors import TesselError

EXAMPLES = settings(max_examples=15, deadline=None)


class RecordingTokenizer:
    """A tokenizer that remembers every text it is given, then tokenizes it with the real one."""

    def __init__(self, tokenizer: Any) -> None:
        self.inner, self.seen = tokenizer, []
        self.chat_template = getattr(tokenizer, "chat_template", None) or "{{ messages[0]['content'] }}"

    def __call__(self, texts: Any, *args: Any, **kwargs: Any) -> Any:
        self.seen.extend([texts] if isinstance(texts, str) else texts)
        return self.inner(texts, *args, **kwargs)

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        self.seen.extend(message["content"] for message in messages)
        return self.inner(messages[0]["content"])["input_ids"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("text") / "tiny-llama", arch="llama")


@pytest.fixture(scope="module")
def engine(llama: Path) -> Any:
    from tessel.engine.llm_engine import LLMEngine

    return LLMEngine(str(llama), max_num_seqs=2, max_model_len=64, kv_cache_gib=0.01)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from encoder_models import make_tiny_bert
    from tessel.models.embedder import Embedder

    return Embedder(make_tiny_bert(tmp_path_factory.mktemp("text") / "tiny-bert", max_seq_length=16))


def _refusal(call: Any) -> str:
    """What `call()` is refused with: a user error, or a request model's 400 (a pydantic error)."""
    with pytest.raises((TesselError, pydantic.ValidationError)) as refused:
        call()
    return str(refused.value)


@EXAMPLES
@given(bad=lone_surrogate_texts())
def test_the_server_request_models_refuse_it(bad: tuple[str, str]) -> None:
    from tessel.server.embeddings import EmbeddingRequest
    from tessel.server.protocol import ChatCompletionRequest, CompletionRequest

    text, refusal = bad
    bodies = {
        CompletionRequest: [{"prompt": text}, {"prompt": "hi", "stop": [text]}],
        ChatCompletionRequest: [{"messages": [{"role": "user", "content": text}]}],
        EmbeddingRequest: [{"input": text}, {"input": ["hi", text]}],
    }
    for model, cases in bodies.items():
        for body in cases:
            assert refusal in _refusal(lambda model=model, body=body: model.model_validate(body)), body


@EXAMPLES
@given(bad=lone_surrogate_texts())
def test_no_tokenizer_is_handed_it(bad: tuple[str, str], engine: Any, embedder: Any) -> None:
    from tessel.server.app import _chat_prompt_ids
    from tessel.server.replica_router import count_prompt_tokens

    text, refusal = bad
    spy = RecordingTokenizer(engine.tokenizer)
    assert refusal in _refusal(lambda: engine.tokenize(text, spy))
    assert refusal in _refusal(lambda: _chat_prompt_ids(spy, [{"role": "user", "content": text}], None))
    assert count_prompt_tokens(spy, {"prompt": text}, chat=False) == 0  # the backend answers the 400
    chat = {"messages": [{"role": "user", "content": text}]}
    assert count_prompt_tokens(spy, chat, chat=True) == 0
    real = embedder.tokenizer
    embedder.tokenizer = RecordingTokenizer(real)
    try:
        assert refusal in _refusal(lambda: embedder.tokenize(["hello", text]))
        assert embedder.tokenizer.seen == []
    finally:
        embedder.tokenizer = real
    assert spy.seen == []


@EXAMPLES
@given(bad=lone_surrogate_texts())
def test_launch_refuses_it_before_any_stage_starts(bad: tuple[str, str], llama: Path, engine: Any) -> None:
    from tessel.engine.sampling_params import SamplingParams
    from tessel.pipeline.checks import check_requests
    from tessel.pipeline.prompts_file import RunRequest

    text, refusal = bad
    requests = [RunRequest("hello", SamplingParams(), "x:1"), RunRequest(text, SamplingParams(), "x:2")]
    message = _refusal(lambda: check_requests(requests, llama, engine.model_config, {"max_model_len": 64}))
    assert message.startswith("x:2: ") and refusal in message


@EXAMPLES
@given(bad=lone_surrogate_texts())
def test_generate_names_the_prompt(bad: tuple[str, str], llama: Path) -> None:
    """A command line's bytes that are not UTF-8 reach Python as lone surrogates."""
    from tessel.cli import app

    text, refusal = bad
    args = ["generate", "--model", str(llama), "--prompt", "hello", "--prompt", text, "--max-tokens", "1"]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, TesselError) and result.exception.exit_code == 2
    assert f"--prompt 2 is not valid Unicode: a {refusal}" in str(result.exception)
