"""`tessel serve` as a live subprocess on 127.0.0.1, driven by the official `openai` client.

Greedy outputs must equal `LLM.generate` on the same checkpoint; streamed chunks must add up to
the non-streamed text; an over-long prompt must come back as `openai.BadRequestError` naming the
limit.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from serve_process import start_serving

openai = pytest.importorskip("openai")

TIMEOUT_S = 60.0  # per request or process wait; healthy ones take a fraction of it
MAX_MODEL_LEN = 128
KV_CACHE_GIB = 0.01
PROMPT = "Once upon a time there was"
MESSAGES = [{"role": "user", "content": "Tell me a story about a small model."}]


def _healthy(url: str, process: subprocess.Popen) -> bool:
    if process.poll() is not None:
        return True  # exited: stop waiting, the fixture reports why
    try:
        return httpx.get(f"{url}/health", timeout=5.0).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def server_url(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, wait_until: Any) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [sys.executable, "-m", "tessel.cli", "serve", "--model", str(tiny_model)]
    command += ["--max-model-len", str(MAX_MODEL_LEN)]
    command += ["--max-num-seqs", "4", "--kv-cache-gib", str(KV_CACHE_GIB), "--max-queue", "8"]
    command += ["--log-level", "info"]  # info: the shutdown line checked at teardown
    with log_path.open("w") as log:
        process, url = start_serving(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: _healthy(url, process), "`tessel serve` to answer /health", TIMEOUT_S * 2)
            assert process.poll() is None, f"`tessel serve` exited:\n{log_path.read_text()}"
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=TIMEOUT_S)
    # SIGTERM is a clean shutdown: the app's lifespan (which stops the engine thread) completes;
    # uvicorn then re-raises the signal, so the exit status is 0 or -SIGTERM
    log_text = log_path.read_text()
    assert process.returncode in (0, -signal.SIGTERM), (
        f"`tessel serve` exited {process.returncode}:\n{log_text}"
    )
    assert "Application shutdown complete" in log_text, log_text


@pytest.fixture(scope="module")
def client(server_url: str) -> Any:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def oracle(tiny_model: Path) -> Any:
    from tessel.engine.llm_engine import LLM
    from tessel.engine.sampling_params import SamplingParams

    llm = LLM(str(tiny_model), max_model_len=MAX_MODEL_LEN, kv_cache_gib=KV_CACHE_GIB)

    def generate(prompt: str | list[int], **sampling: Any) -> Any:
        return llm.generate([prompt], SamplingParams(**sampling))[0]

    return generate


@pytest.fixture(scope="module")
def chat_prompt_ids(tiny_model: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False))


pytestmark = pytest.mark.slow  # starts a server process (imports torch, loads the model): ~10 s


def test_models_lists_the_checkpoint(client: Any, tiny_model: Path) -> None:
    assert [model.id for model in client.models.list()] == [tiny_model.name]


def test_completion_equals_llm_generate(client: Any, oracle: Any, tiny_model: Path) -> None:
    expected = oracle(PROMPT, temperature=0.0, max_tokens=20)
    result = client.completions.create(model=tiny_model.name, prompt=PROMPT, max_tokens=20, temperature=0)
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.token_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_chat_equals_llm_generate_on_the_template(
    client: Any, oracle: Any, tiny_model: Path, chat_prompt_ids: list[int]
) -> None:
    expected = oracle(chat_prompt_ids, temperature=0.0, max_tokens=20)
    result = client.chat.completions.create(
        model=tiny_model.name, messages=MESSAGES, max_tokens=20, temperature=0
    )
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.usage.prompt_tokens == len(chat_prompt_ids)
    assert result.usage.completion_tokens == len(expected.token_ids)


def test_streamed_completion_reassembles_to_the_greedy_text(client: Any, tiny_model: Path) -> None:
    args = {"model": tiny_model.name, "prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    full = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text_chunks = [chunk for chunk in chunks if chunk.choices]
    assert len(text_chunks) > 1
    assert "".join(chunk.choices[0].text for chunk in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_streamed_chat_reassembles_to_the_greedy_text(client: Any, tiny_model: Path) -> None:
    args = {"model": tiny_model.name, "messages": MESSAGES, "max_tokens": 30, "temperature": 0}
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == full.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_over_long_prompt_is_a_bad_request_naming_the_limit(client: Any, tiny_model: Path) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=tiny_model.name, prompt="hello " * MAX_MODEL_LEN, max_tokens=8)
    assert caught.value.status_code == 400
    assert str(MAX_MODEL_LEN) in caught.value.message
    with pytest.raises(openai.BadRequestError, match=str(MAX_MODEL_LEN)):
        client.chat.completions.create(
            model=tiny_model.name, messages=[{"role": "user", "content": "hello " * MAX_MODEL_LEN}]
        )


def test_serve_rejects_a_missing_model_directory(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [sys.executable, "-m", "tessel.cli", "serve", "--model", str(missing), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 2
    assert "not a directory" in result.stderr and "Traceback" not in result.stderr
