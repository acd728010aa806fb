"""n > 1 choices (issue 15) through the official `openai` client on a live server, once per engine
kind (conftest: one process; a 2-stage pipeline as `serve --plan` runs it; a 2-replica plan's router).

Oracle: choice i with seed s equals an n = 1 request with seed s + i (its own seed stream), streamed
or not; the later choices reuse the prompt's full KV blocks from the prefix cache (the engine's
cached-token count); usage counts the prompt once and every choice's tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")

PROMPT = "Once upon a time there was a small model that wanted to write stories about"
N = 3


@pytest.fixture(scope="module")
def engine(make_engine: Any) -> Any:
    with make_engine(max_num_seqs=4, max_model_len=256, kv_cache_gib=0.01) as engine:
        yield engine


@pytest.fixture(scope="module")
def served(engine: Any, serve_engine: Any) -> Any:
    with serve_engine(engine, max_pending=8) as served:
        yield served


@pytest.fixture(scope="module")
def server(served: Any) -> Any:
    """The client, and the app (None for the replicas kind: tests marked in_process_engine use it)."""
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=60.0), served.app


def test_choices_equal_single_requests_with_consecutive_seeds(
    server: Any, served: Any, engine: Any, tiny_model: Path
) -> None:
    client, _ = server
    kw = dict(
        model=tiny_model.name, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True}
    )
    singles = [client.completions.create(**kw, seed=100 + i).choices[0].text for i in range(N)]
    assert len(set(singles)) > 1  # the seeds do give different samples
    multi = client.completions.create(**kw, seed=100, n=N)
    assert [c.index for c in multi.choices] == list(range(N))
    assert [c.text for c in multi.choices] == singles
    prompt_tokens = len(engine.tokenizer(PROMPT).input_ids)
    assert multi.usage.prompt_tokens == prompt_tokens and multi.usage.completion_tokens == N * 8

    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**kw, seed=100, n=N, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(N)] == singles
    served.wait_idle()  # every choice's blocks returned


@pytest.mark.in_process_engine
def test_a_client_leaving_an_n_stream_aborts_every_choice(
    server: Any, engine: Any, tiny_model: Path, wait_until: Any
) -> None:
    client, app = server
    aborted = app.state.async_engine.num_aborted
    kw = dict(
        model=tiny_model.name, prompt=PROMPT, max_tokens=200, temperature=0, extra_body={"ignore_eos": True}
    )
    stream = client.completions.create(**kw, n=N, stream=True)
    next(iter(stream))
    stream.close()  # the client goes away mid-stream
    wait_until(lambda: app.state.async_engine.num_aborted == aborted + N, "all choices to be aborted")
    wait_until(lambda: engine.num_free_blocks == engine.num_total_blocks, "the KV blocks to return")


@pytest.mark.in_process_engine
def test_later_choices_share_the_prompt_blocks(
    server: Any, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefix cache hands choices 1.. the prompt's full blocks computed by choice 0."""
    client, app = server
    cached: dict[str, int] = {}
    real_observe = app.state.metrics.observe

    def observe(outputs, now_s):
        for out in outputs:
            if out.finished:
                cached[out.request_id] = out.metrics.num_cached_tokens
        real_observe(outputs, now_s)

    monkeypatch.setattr(app.state.async_engine, "on_outputs", observe)
    prompt = "Paged attention keeps keys and values in blocks; a table maps positions to blocks"  # uncached
    client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4, n=N, temperature=0.5, seed=1)
    by_choice = [cached[rid] for rid in sorted(cached, key=lambda r: int(r.rsplit("-", 1)[1]))]
    block = engine.config.block_size
    full_blocks = (len(engine.tokenizer(prompt).input_ids) - 1) // block * block
    assert full_blocks > 0 and by_choice == [0] + [full_blocks] * (N - 1)


def test_chat_choices_stream_interleaved_by_index(server: Any, tiny_model: Path) -> None:
    client, _ = server
    kw = dict(
        model=tiny_model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=1.0
    )
    full = client.chat.completions.create(**kw, n=N, seed=7)
    texts = [c.message.content for c in full.choices]
    streamed: dict[int, str] = {}
    finished = set()
    for chunk in client.chat.completions.create(**kw, n=N, seed=7, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert [streamed[i] for i in range(N)] == texts and finished == set(range(N))
