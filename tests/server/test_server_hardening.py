"""A hostile client against a live server (uvicorn on 127.0.0.1, a free port, in a thread) (issue 14).

The denial-of-service request of the issue (`top_k` = 2**64) must be a 400 for its sender while a
normal request from another client succeeds and a stream in flight for a third is not cut. Every
other hostile field is a 400 naming it; limits answer 400 / 413 naming the limit; tokenizing a
huge prompt never holds up a short request (checked by ordering: the big prompt's tokenization
is parked until the short request has its answer). Oracles: `LLM.generate` on the same checkpoint
for the texts, the engine's free-block count for leaks.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

MAX_MODEL_LEN = 128
MAX_BODY_BYTES = 32 * 1024
MAX_PROMPT_CHARS = 4000
MAX_PROMPT_TOKENS = 100
TIMEOUT_S = 60.0  # per HTTP request; a healthy one takes milliseconds
DOS_BODY = {"prompt": "hello", "temperature": 1, "top_k": 18446744073709551616}


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Any:
    from tessel.engine.llm_engine import LLMEngine

    return LLMEngine(str(tiny_model), max_num_seqs=4, max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.01)


@pytest.fixture(scope="module")
def app(engine: Any) -> Any:
    from tessel.server.app import create_app
    from tessel.server.limits import ServerLimits

    limits = ServerLimits(
        max_body_bytes=MAX_BODY_BYTES, max_prompt_chars=MAX_PROMPT_CHARS, max_prompt_tokens=MAX_PROMPT_TOKENS
    )
    return create_app(engine, max_pending=8, limits=limits)


@pytest.fixture(scope="module")
def base_url(app: Any, serve_in_thread: Any) -> str:
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture
def client(base_url: str, engine: Any, app: Any, wait_until: Any) -> httpx.Client:
    with httpx.Client(base_url=base_url, timeout=TIMEOUT_S) as client:
        yield client
    wait_until(lambda: app.state.async_engine.num_pending == 0, "the server to release its requests")
    wait_until(lambda: not engine.has_unfinished_requests(), "the engine to finish its requests")
    assert engine.num_free_blocks == engine.num_total_blocks


@pytest.fixture(scope="module")
def oracle(tiny_model: Path) -> Any:
    from tessel.engine.llm_engine import LLM
    from tessel.engine.sampling_params import SamplingParams

    llm = LLM(str(tiny_model), max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.01)
    return lambda prompt, **kw: llm.generate([prompt], SamplingParams(**kw))[0]


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _raw(client: httpx.Client, path: str, text: str) -> httpx.Response:
    """POST a JSON text as is (NaN literals, \\ud800 escapes: what json= cannot send)."""
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"})


def test_the_dos_request_fails_alone(client: httpx.Client, base_url: str, oracle: Any) -> None:
    expected = oracle("Once upon a time", temperature=0.0, max_tokens=60, ignore_eos=True)
    stream_body = {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=TIMEOUT_S) as third:
        with third.stream("POST", "/v1/completions", json={**stream_body, "stream": True}) as response:
            lines = (line for line in response.iter_lines() if line)
            first = json.loads(next(lines).removeprefix("data: "))  # the stream is in flight
            error = _error(client.post("/v1/completions", json=DOS_BODY), 400)
            assert error["type"] == "invalid_request_error" and "top_k" in error["message"]
            with httpx.Client(base_url=base_url, timeout=TIMEOUT_S) as second:
                normal = second.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
                assert normal.status_code == 200, normal.text
                assert second.get("/health").json() == {"status": "ok"}
            rest = [line.removeprefix("data: ") for line in lines]
    assert rest[-1] == "[DONE]"
    chunks = [first] + [json.loads(line) for line in rest[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text  # not cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_the_dos_request_through_chat_and_streams_is_400(client: httpx.Client) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1, "top_k": 2**64}
    assert "top_k" in _error(client.post("/v1/chat/completions", json=chat), 400)["message"]
    assert (
        "top_k" in _error(client.post("/v1/completions", json={**DOS_BODY, "stream": True}), 400)["message"]
    )


@pytest.mark.parametrize(
    ("text", "param"),
    [
        ('{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
        ('{"prompt": "hi", "seed": -1}', "seed"),
        ('{"prompt": "hi", "seed": "abc"}', "seed"),
        ('{"prompt": "hi", "top_k": 1.5}', "top_k"),
        ('{"prompt": "hi", "top_k": true}', "top_k"),
        ('{"prompt": "hi", "max_tokens": 2.5}', "max_tokens"),
        ('{"prompt": "hi", "max_tokens": "3"}', "max_tokens"),
        ('{"prompt": "hi", "temperature": NaN}', "temperature"),
        ('{"prompt": "hi", "temperature": Infinity}', "temperature"),
        ('{"prompt": "hi", "top_p": NaN}', "top_p"),
        ('{"prompt": "hi", "n": true}', "n"),
        ('{"prompt": "hi", "stream": "yes"}', "stream"),
        ('{"prompt": "hi", "ignore_eos": 1}', "ignore_eos"),
        ('{"prompt": "hi", "stop": ["a", 3]}', "stop"),
        ('{"prompt": "\\ud800 w1"}', "prompt"),
        ('{"prompt": ["\\udfff"]}', "prompt"),
        ('{"prompt": [1, true]}', "prompt"),
        ('{"prompt": "hi", "stop": "\\ud800"}', "stop"),
    ],
)
def test_bad_completion_fields_are_400_naming_them(client: httpx.Client, text: str, param: str) -> None:
    error = _error(_raw(client, "/v1/completions", text), 400)
    assert error["param"] == param, error


def test_seed_out_of_range_keeps_the_connection(client: httpx.Client) -> None:
    _error(client.post("/v1/completions", json={"prompt": "hi", "seed": 2**64}), 400)
    ok = client.post("/v1/completions", json={"prompt": "hi", "seed": 2**64 - 1, "max_tokens": 3})
    assert ok.status_code == 200, ok.text


def _chat(messages: list, **fields: Any) -> dict:
    return {"messages": messages, "max_tokens": 4, **fields}


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (json.dumps(_chat([{"role": "tool", "tool_call_id": "1"}])), "content is required"),
        (json.dumps(_chat([{"role": "function", "content": "x"}])), "'function'"),
        (json.dumps(_chat([{"role": "banana", "content": "x"}])), "'banana'"),
        (json.dumps(_chat([{"role": "user", "content": None}])), "content"),
        (json.dumps(_chat([{"role": "user"}])), "content"),
        (json.dumps(_chat([{"role": "user", "content": [{"type": "text"}]}])), "content"),
        (json.dumps(_chat([USER], stream="yes")), "stream"),
        (json.dumps(_chat([USER], tools=[{"type": "function", "function": {"description": "f"}}])), "name"),
        (json.dumps(_chat([USER], functions=[{"name": "f"}])), "'functions'"),
        (json.dumps(_chat([USER], response_format={"type": "xml"})), "'xml'"),
        (json.dumps(_chat([USER], banana=1)), "'banana'"),
        (json.dumps(_chat([{**USER, "tool_calls": [{"id": "1"}]}])), "function: {name, arguments}"),
        ('{"messages": [{"role": "user", "content": "\\ud800 w1"}]}', "surrogate"),
        ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', "surrogate"),
    ],
)
def test_bad_chat_bodies_are_400_naming_the_problem(client: httpx.Client, text: str, named: str) -> None:
    error = _error(_raw(client, "/v1/chat/completions", text), 400)
    assert named in error["message"], error


def test_no_op_values_of_unsupported_fields_are_accepted(client: httpx.Client) -> None:
    body = _chat(
        [USER, {"role": "assistant", "content": "hello", "tool_calls": None}, USER],
        presence_penalty=0,
        frequency_penalty=0.0,
        tools=[],
        tool_choice="none",
        logit_bias={},
        user="someone",
        temperature=None,
    )
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 1}),  # issue 27: was accepted
        ("/v1/completions", {"prompt": "hi", "best_of": 3}),
        ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 4}),
        ("/v1/completions", {"prompt": "hi", "best_of": True}),
        ("/v1/completions", {"prompt": "hi", "best_of": 1.5}),
        ("/v1/chat/completions", _chat([USER], n=2, best_of=1)),
    ],
)
def test_best_of_other_than_n_is_400_naming_it(client: httpx.Client, path: str, fields: dict) -> None:
    """best_of (the n best of best_of candidates) is not implemented: only best_of == n changes nothing."""
    message = _error(client.post(path, json={"max_tokens": 2, **fields}), 400)["message"]
    assert "best_of" in message and "does not implement" in message, message


@pytest.mark.parametrize(("n", "best_of"), [(2, 2), (1, 1), (2, None)])
def test_best_of_equal_to_n_or_absent_is_served(client: httpx.Client, n: int, best_of: int | None) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "n": n, "best_of": best_of}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == n


def test_limits_answer_with_the_limit(client: httpx.Client, engine: Any) -> None:
    huge = {"prompt": "x" * (MAX_BODY_BYTES + 1)}
    error = _error(client.post("/v1/completions", json=huge), 413)
    assert str(MAX_BODY_BYTES) in error["message"]

    def chunked():  # no Content-Length: the limit is counted while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 1000 + 1):
            yield b"y" * 1000
        yield b'"}'

    error = _error(client.post("/v1/completions", content=chunked()), 413)
    assert str(MAX_BODY_BYTES) in error["message"]
    error = _error(client.post("/v1/completions", json={"prompt": "z" * (MAX_PROMPT_CHARS + 1)}), 400)
    assert "max_prompt_chars" in error["message"] and str(MAX_PROMPT_CHARS) in error["message"]
    chat = _chat([{"role": "user", "content": "z" * (MAX_PROMPT_CHARS // 2 + 1)}] * 2)
    assert "max_prompt_chars" in _error(client.post("/v1/chat/completions", json=chat), 400)["message"]
    ids = [5] * (MAX_PROMPT_TOKENS + 1)
    error = _error(client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}), 400)
    assert "max_prompt_tokens" in error["message"] and str(MAX_PROMPT_TOKENS) in error["message"]
    text = "hello " * 150  # within max_prompt_chars, over max_prompt_tokens once tokenized
    assert len(engine.tokenizer(text).input_ids) > MAX_PROMPT_TOKENS
    error = _error(client.post("/v1/completions", json={"prompt": text, "max_tokens": 1}), 400)
    assert "max_prompt_tokens" in error["message"]


def test_tokenizing_a_big_prompt_does_not_hold_up_a_short_request(
    client: httpx.Client, base_url: str, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The big prompt's tokenization is parked until the short request has its answer."""
    started, release = threading.Event(), threading.Event()
    real_tokenize = engine.tokenize

    def tokenize(prompt, tokenizer=None):
        if isinstance(prompt, str) and prompt.startswith("BIG"):
            started.set()
            assert release.wait(TIMEOUT_S), "never released"
        return real_tokenize(prompt, tokenizer)

    monkeypatch.setattr(engine, "tokenize", tokenize)
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(
            httpx.post,
            f"{base_url}/v1/completions",
            json={"prompt": "BIG hello", "max_tokens": 2},
            timeout=TIMEOUT_S,
        )
        try:
            assert started.wait(TIMEOUT_S), "the big prompt was never tokenized"
            short = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT_S)
            assert short.status_code == 200, short.text
            assert not big.done()  # still tokenizing: the short request went past it
        finally:
            release.set()
        assert big.result().status_code == 200


def test_a_request_that_fails_in_the_engine_fails_alone(
    client: httpx.Client, base_url: str, engine: Any, monkeypatch: pytest.MonkeyPatch, oracle: Any
) -> None:
    marker = engine.model_config.vocab_size - 1
    real_run = engine.runner.run

    def run(batch):
        if any(marker in seq.prompt_token_ids for seq, _ in batch.scheduled()):
            raise OverflowError("Overflow when unpacking long long")
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", run)
    expected = oracle("Once upon", temperature=0.0, max_tokens=8, ignore_eos=True).text
    good = {"prompt": "Once upon", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(client.post, "/v1/completions", json={"prompt": [1, 2, marker], "max_tokens": 8})
        ok = pool.submit(httpx.post, f"{base_url}/v1/completions", json=good, timeout=TIMEOUT_S)
        failed, fine = bad.result(), ok.result()
    error = _error(failed, 500)
    assert error["code"] == "request_failed" and "OverflowError" in error["message"]
    assert fine.status_code == 200 and fine.json()["choices"][0]["text"] == expected
    assert client.get("/health").json() == {"status": "ok"}
