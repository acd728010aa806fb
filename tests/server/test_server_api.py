"""The HTTP API over a live server with a real engine, once per engine kind (conftest: one process; a
2-stage pipeline as `serve --plan` runs it; the router of a 2-replica plan in front of two servers).

Greedy outputs are checked against `LLM.generate` on the same checkpoint (the oracle); error
bodies against OpenAI's shape; a full server against 429; and a client that goes away, mid-stream
or mid-request, against the engine's free-block count returning to its total.
"""

from __future__ import annotations

import asyncio
import json
import socket
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 2
MAX_PENDING = 2  # running + waiting; a third request gets 429
KV_CACHE_GIB = 0.01
LONG_MAX_TOKENS = MAX_MODEL_LEN - 32  # far more steps than a disconnect takes to notice
TIMEOUT_S = 60.0  # per HTTP request; a healthy one takes milliseconds
PROMPTS = ["The quick brown fox", "Once upon a time there was", "Hello world! How are you"]


@pytest.fixture(scope="module")
def engine(make_engine: Any) -> Any:
    """Per engine kind (conftest): one process, or a 2-stage pipeline of the same checkpoint."""
    options = {"max_model_len": MAX_MODEL_LEN, "kv_cache_gib": KV_CACHE_GIB}
    with make_engine(max_num_seqs=MAX_NUM_SEQS, **options) as engine:
        yield engine


@pytest.fixture(scope="module")
def served(engine: Any, serve_engine: Any) -> Any:
    with serve_engine(engine, max_pending=MAX_PENDING) as served:
        yield served


@pytest.fixture(scope="module")
def app(served: Any) -> Any:
    return served.app  # in-process kinds (tests marked in_process_engine)


@pytest.fixture(scope="module")
def base_url(served: Any) -> str:
    return served.url


@pytest.fixture
def client(base_url: str, served: Any) -> httpx.Client:
    with httpx.Client(base_url=base_url, timeout=60.0) as client:
        yield client
    served.wait_idle()  # every test leaves the engine empty: all blocks back in the pool, nothing pending


@pytest.fixture(scope="module")
def oracle(tiny_model: Path) -> Any:
    """`generate(prompt, **sampling) -> output` from the offline `LLM` API (a separate engine)."""
    from tessel.engine.llm_engine import LLM
    from tessel.engine.sampling_params import SamplingParams

    llm = LLM(str(tiny_model), max_model_len=MAX_MODEL_LEN, kv_cache_gib=KV_CACHE_GIB)

    def generate(prompt: str | list[int], **sampling: Any) -> Any:
        return llm.generate([prompt], SamplingParams(**sampling))[0]

    return generate


def _assert_openai_error(response: httpx.Response, status: int, type_: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if type_ is not None:
        assert body["error"]["type"] == type_
    return body["error"]


def _sse_events(lines: list[str]) -> list[Any]:
    """Parse `data: ...` lines; the last event must be [DONE] and is returned as the string."""
    events = [line.removeprefix("data: ") for line in lines if line]
    assert all(line.startswith("data: ") for line in lines if line), lines
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]] + ["[DONE]"]


def test_health_and_models(client: httpx.Client, tiny_model: Path) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [card["id"] for card in models["data"]] == [tiny_model.name]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_llm_generate(client: httpx.Client, oracle: Any, prompt: str) -> None:
    expected = oracle(prompt, temperature=0.0, max_tokens=24)
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["object"] == "text_completion"
    assert result["choices"][0]["text"] == expected.text
    assert result["choices"][0]["finish_reason"] == expected.finish_reason
    usage = result["usage"]
    assert usage["prompt_tokens"] == len(expected.prompt_token_ids)
    assert usage["completion_tokens"] == len(expected.token_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_token_id_prompt_equals_text_prompt(client: httpx.Client, engine: Any, oracle: Any) -> None:
    prompt_ids = list(engine.tokenizer(PROMPTS[1]).input_ids)
    expected = oracle(PROMPTS[1], temperature=0.0, max_tokens=12)
    response = client.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected.text
    assert response.json()["usage"]["prompt_tokens"] == len(prompt_ids)


def test_usage_counts_max_tokens_when_eos_is_ignored(client: httpx.Client) -> None:
    body = {"prompt": PROMPTS[2], "max_tokens": 37, "temperature": 0, "ignore_eos": True}
    result = client.post("/v1/completions", json=body).json()
    assert result["choices"][0]["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 37


def test_chat_uses_the_chat_template(client: httpx.Client, engine: Any, oracle: Any) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    prompt_ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    expected = oracle(list(prompt_ids), temperature=0.0, max_tokens=20)
    response = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 20, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["object"] == "chat.completion"
    assert result["choices"][0]["message"] == {"role": "assistant", "content": expected.text}
    assert result["usage"]["prompt_tokens"] == len(prompt_ids)
    assert result["usage"]["completion_tokens"] == len(expected.token_ids)


def test_stop_string_equals_llm_generate_streamed_or_not(client: httpx.Client, oracle: Any) -> None:
    free = oracle(PROMPTS[0], temperature=0.0, max_tokens=30, ignore_eos=True).text
    middle = range(len(free) // 3, len(free) - 2)
    stop = next(free[i : i + 2] for i in middle if free[i : i + 2].isprintable() and free[i : i + 2].strip())
    expected = oracle(PROMPTS[0], temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    assert len(expected.text) < len(free) and stop not in expected.text  # it did cut the text
    body = {"prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    result = client.post("/v1/completions", json=body).json()
    assert result["choices"][0]["text"] == expected.text
    assert result["choices"][0]["finish_reason"] == "stop" == expected.finish_reason
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        chunks = _sse_events(list(response.iter_lines()))[:-1]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == expected.text  # stop never shown
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible_and_equals_llm_generate(client: httpx.Client, oracle: Any) -> None:
    sampling = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234, "max_tokens": 16}
    expected = oracle(PROMPTS[1], **sampling)
    texts = [
        client.post("/v1/completions", json={"prompt": PROMPTS[1], **sampling}).json()["choices"][0]["text"]
        for _ in range(2)
    ]
    assert texts == [expected.text, expected.text]


def test_stream_chunks_reassemble_to_the_greedy_text(client: httpx.Client, oracle: Any) -> None:
    expected = oracle(PROMPTS[0], temperature=0.0, max_tokens=24)
    body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(list(response.iter_lines()))
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert len({chunk["id"] for chunk in events[:-1]}) == 1
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == expected.text
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks][-1] == expected.finish_reason
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(expected.token_ids)


def test_chat_stream_starts_with_the_role_and_ends_with_done(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0}
    full = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        events = _sse_events(list(response.iter_lines()))
    chunks = events[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks) == full
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_concurrent_requests_equal_their_sequential_results(
    base_url: str, client: httpx.Client, oracle: Any
) -> None:
    expected = [oracle(prompt, temperature=0.0, max_tokens=20).text for prompt in PROMPTS[:MAX_PENDING]]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as aclient:
            bodies = [{"prompt": p, "max_tokens": 20, "temperature": 0} for p in PROMPTS[:MAX_PENDING]]
            responses = await asyncio.gather(*(aclient.post("/v1/completions", json=b) for b in bodies))
        return [r.json()["choices"][0]["text"] for r in responses]

    assert asyncio.run(run()) == expected


# ---- errors ------------------------------------------------------------------------------------


@pytest.mark.single_engine
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "n": 17}, "n"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "stream": "sometimes"}, "stream"),
    ],
)
def test_malformed_completion_bodies_are_400(client: httpx.Client, body: dict, param: str) -> None:
    error = _assert_openai_error(client.post("/v1/completions", json=body), 400, "invalid_request_error")
    assert error["param"] == param


@pytest.mark.single_engine
def test_malformed_chat_bodies_and_json_are_400(client: httpx.Client) -> None:
    _assert_openai_error(client.post("/v1/chat/completions", json={"messages": []}), 400)
    _assert_openai_error(client.post("/v1/chat/completions", json={"messages": [{"content": "x"}]}), 400)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    error = _assert_openai_error(client.post("/v1/chat/completions", json={"messages": image}), 400)
    assert error["param"] == "messages.0.content" and "image_url" in error["message"]
    raw = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert "JSON" in _assert_openai_error(raw, 400)["message"]


def test_chat_content_parts_equal_plain_content(client: httpx.Client) -> None:
    plain = [{"role": "user", "content": "Hello world"}]
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]}
    ]
    texts = [
        client.post("/v1/chat/completions", json={"messages": m, "max_tokens": 8, "temperature": 0}).json()
        for m in (plain, parts)
    ]
    assert texts[0]["choices"][0]["message"] == texts[1]["choices"][0]["message"]
    assert texts[0]["usage"] == texts[1]["usage"]


@pytest.mark.single_engine
def test_token_ids_outside_the_vocabulary_are_400(client: httpx.Client, engine: Any) -> None:
    vocab_size = len(engine.tokenizer)
    error = _assert_openai_error(client.post("/v1/completions", json={"prompt": [1, vocab_size]}), 400)
    assert str(vocab_size) in error["message"]


@pytest.mark.single_engine
def test_unknown_model_and_route_are_404(client: httpx.Client) -> None:
    error = _assert_openai_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404)
    assert error["code"] == "model_not_found" and "gpt-9" in error["message"]
    _assert_openai_error(client.get("/v1/nothing-here"), 404)


def test_prompt_over_the_model_length_is_400_naming_the_limit(client: httpx.Client, engine: Any) -> None:
    prompt_ids = list(engine.tokenizer(PROMPTS[0]).input_ids)
    body = {"prompt": prompt_ids, "max_tokens": MAX_MODEL_LEN - len(prompt_ids) + 1}
    error = _assert_openai_error(client.post("/v1/completions", json=body), 400, "invalid_request_error")
    assert str(MAX_MODEL_LEN) in error["message"]
    chat = {"messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]}
    error = _assert_openai_error(client.post("/v1/chat/completions", json=chat), 400)
    assert str(MAX_MODEL_LEN) in error["message"]
    ok = client.post(
        "/v1/completions", json={**body, "max_tokens": body["max_tokens"] - 1, "ignore_eos": True}
    )
    assert ok.status_code == 200, ok.text  # exactly at the limit is allowed
    assert ok.json()["usage"]["total_tokens"] == MAX_MODEL_LEN


@pytest.mark.in_process_engine
def test_full_server_answers_429_then_recovers(
    client: httpx.Client, base_url: str, app: Any, wait_until: Any, engine_paused: Any
) -> None:
    async_engine = app.state.async_engine
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0}
    with ThreadPoolExecutor(MAX_PENDING) as pool:
        with engine_paused(async_engine):  # the admitted requests stay pending until it ends
            admitted = [
                pool.submit(httpx.post, f"{base_url}/v1/completions", json=body, timeout=TIMEOUT_S)
                for _ in range(MAX_PENDING)
            ]
            wait_until(lambda: async_engine.num_pending == MAX_PENDING, "the server to fill up")
            error = _assert_openai_error(client.post("/v1/completions", json=body), 429)
            assert error["type"] == "rate_limit_exceeded" and error["code"] == "queue_full"
            assert str(MAX_PENDING) in error["message"]
        assert [future.result().status_code for future in admitted] == [200] * MAX_PENDING
    response = client.post("/v1/completions", json=body)  # and it takes requests again
    assert response.status_code == 200, response.text


def _long_stream_body(prompt: str) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": LONG_MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


@pytest.mark.in_process_engine
def test_disconnect_mid_stream_aborts_and_frees_blocks(
    base_url: str, client: httpx.Client, engine: Any, app: Any, wait_until: Any, engine_paused: Any
) -> None:
    async_engine = app.state.async_engine
    aborted_before = async_engine.num_aborted
    with ExitStack() as paused:
        with httpx.Client(base_url=base_url, timeout=TIMEOUT_S) as other:
            with other.stream("POST", "/v1/completions", json=_long_stream_body(PROMPTS[1])) as response:
                lines = response.iter_lines()  # kept: dropping it would close the connection here
                assert next(lines).startswith("data: ")
                paused.enter_context(engine_paused(async_engine))
                assert engine.has_unfinished_requests()  # so the client leaves mid-stream
                assert engine.num_free_blocks < engine.num_total_blocks
                assert async_engine.num_aborted == aborted_before and async_engine.num_pending == 1
        wait_until(lambda: async_engine.num_pending == 0, "the server to notice the disconnect")
    wait_until(lambda: async_engine.num_aborted == aborted_before + 1, "the request to be aborted")
    wait_until(lambda: engine.num_free_blocks == engine.num_total_blocks, "the KV blocks to return")
    assert not engine.has_unfinished_requests()


@pytest.mark.in_process_engine
def test_disconnect_mid_request_aborts_and_frees_blocks(
    base_url: str, client: httpx.Client, engine: Any, app: Any, wait_until: Any, engine_paused: Any
) -> None:
    async_engine = app.state.async_engine
    aborted_before = async_engine.num_aborted
    host, port = base_url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPTS[2], "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(body)}\r\n\r\n"
    with ExitStack() as paused:
        with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
            sock.sendall(head.encode() + body)
            wait_until(lambda: engine.num_free_blocks < engine.num_total_blocks, "the request to run")
            paused.enter_context(engine_paused(async_engine))
            assert engine.has_unfinished_requests()  # so the client leaves before the response
            assert async_engine.num_aborted == aborted_before and async_engine.num_pending == 1
        wait_until(lambda: async_engine.num_pending == 0, "the server to notice the disconnect")
    wait_until(lambda: async_engine.num_aborted == aborted_before + 1, "the request to be aborted")
    wait_until(lambda: engine.num_free_blocks == engine.num_total_blocks, "the KV blocks to return")
    assert not engine.has_unfinished_requests()
