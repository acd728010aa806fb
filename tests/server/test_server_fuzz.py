"""Hypothesis fuzzing of every endpoint with hostile JSON bodies (issue 14).

Bodies mix plausible fields with huge ints, NaN / Infinity literals, wrong types, lone surrogates,
deep nesting, unknown and unsupported fields, huge strings and raw garbage. Against the ASGI app
(Starlette's TestClient, which re-raises any exception the app lets escape): never a 500, never a
traceback, always an OpenAI-shaped error or a well-formed answer, each case within a deadline;
afterwards the engine still answers a normal request and every KV block is free.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MAX_MODEL_LEN = 48  # keeps every accepted request short
CASE_DEADLINE = timedelta(seconds=30)  # a hang guard, far above a case's normal milliseconds
FUZZ = settings(
    max_examples=120,
    deadline=CASE_DEADLINE,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

_text = st.text(
    st.characters(codec=None, categories=("L", "N", "P", "Zs", "Cs", "So")), max_size=12
)  # Cs: lone surrogates
_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**64, 2**63, -(2**63) - 1, 10**30, 0, -1, 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    _text,
)
_json = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)


def _plausible(field: str) -> st.SearchStrategy:
    return {
        "prompt": st.one_of(
            st.text(min_size=1, max_size=20), st.lists(st.integers(0, 400), min_size=1, max_size=6)
        ),
        "max_tokens": st.integers(1, 4),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1),
        "top_k": st.integers(-1, 500),
        "seed": st.integers(0, 2**64 - 1),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
        "stream": st.booleans(),
        "ignore_eos": st.booleans(),
        "n": st.integers(1, 3),
        "logprobs": st.one_of(st.integers(0, 5), st.booleans()),
        "top_logprobs": st.integers(0, 5),
        "echo": st.booleans(),
    }.get(field, _json)


_FIELDS = [
    "logprobs",
    "top_logprobs",
    "echo",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "ignore_eos",
    "n",
]
_OTHER = [
    "suffix",
    "model",
    "user",
    "tools",
    "stream_options",
    "presence_penalty",
    "banana",
]


@st.composite
def _body(draw: Any, required: str, required_value: st.SearchStrategy) -> Any:
    body = {required: draw(required_value)}
    for field in draw(st.lists(st.sampled_from(_FIELDS + _OTHER), max_size=5, unique=True)):
        hostile = field in _OTHER or draw(st.integers(0, 3)) == 0  # mostly plausible: reach the engine
        body[field] = draw(_json if hostile else _plausible(field))
    if "max_tokens" not in body and draw(st.booleans()):
        body["max_tokens"] = 2
    return body


_valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=20)}
)
_hostile_message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "banana"]), _json)},
    optional={
        "content": st.one_of(
            st.text(max_size=20),
            _json,
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text})),
        ),
        "name": _json,
        "tool_calls": _json,
    },
)
_message = st.one_of(_valid_message, _valid_message, _hostile_message)
_completion_bodies = _body("prompt", st.one_of(_plausible("prompt"), _plausible("prompt"), _json))
_chat_bodies = _body("messages", st.one_of(st.lists(_message, min_size=1, max_size=3), _json))


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


_raw_bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"",
            b"null",
            b"[]",
            b'"prompt"',
            b'{"prompt": "hi", "temperature": NaN}',
            b'{"prompt": "hi", "top_p": -Infinity}',
            b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
            b'{"prompt": ' + _deep(100_000).encode() + b"}",
            _deep(100_000).encode(),
            b'{"prompt": "' + b"a" * 200_000 + b'", "max_tokens": 1}',
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            b"\xff\xfe\x00{",
        ]
    ),
)


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Any:
    from tessel.engine.llm_engine import LLMEngine

    return LLMEngine(str(tiny_model), max_num_seqs=4, max_model_len=MAX_MODEL_LEN, kv_cache_gib=0.01)


@pytest.fixture(scope="module")
def client(engine: Any, wait_until: Any) -> Any:
    from starlette.testclient import TestClient

    from tessel.server.app import create_app
    from tessel.server.limits import ServerLimits

    app = create_app(
        engine, max_pending=8, limits=ServerLimits(max_body_bytes=64 * 1024, max_prompt_chars=10_000)
    )
    with TestClient(app, raise_server_exceptions=True) as client:
        yield client
        # after all the fuzzing: a normal request still works and nothing leaked
        ok = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert ok.status_code == 200, ok.text
        wait_until(lambda: app.state.async_engine.num_pending == 0, "the server to release its requests")
        wait_until(lambda: not engine.has_unfinished_requests(), "the engine to finish")
        assert engine.num_free_blocks == engine.num_total_blocks
        assert app.state.async_engine.healthy and app.state.async_engine.num_restarts == 0


def _check(response: Any, streamed: bool) -> None:
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert "Traceback" not in error["message"]
        return
    if streamed:
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert response.json()["choices"]


def _post(client: Any, path: str, body: Any) -> Any:
    content = json.dumps(body, allow_nan=True).encode()  # ensure_ascii: surrogates as \\ud800 escapes
    return client.post(path, content=content, headers={"content-type": "application/json"})


@FUZZ
@given(body=_completion_bodies)
def test_completions_fuzz(client: Any, body: Any) -> None:
    _check(_post(client, "/v1/completions", body), streamed=body.get("stream") is True)


@FUZZ
@given(body=_chat_bodies)
def test_chat_completions_fuzz(client: Any, body: Any) -> None:
    _check(_post(client, "/v1/chat/completions", body), streamed=body.get("stream") is True)


@settings(FUZZ, max_examples=40)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), raw=_raw_bodies)
def test_raw_bodies_fuzz(client: Any, path: str, raw: bytes) -> None:
    _check(client.post(path, content=raw, headers={"content-type": "application/json"}), streamed=False)


@settings(FUZZ, max_examples=40)
@given(
    path=st.sampled_from(["/v1/models", "/health", "/metrics"]),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
    params=st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
    raw=st.binary(max_size=32),
)
def test_get_routes_fuzz(client: Any, path: str, method: str, params: dict, raw: bytes) -> None:
    response = client.request(method, path, params=params, content=raw)
    assert response.status_code in (200, 405), response.text
    if path != "/metrics" or response.status_code != 200:
        assert response.json()
