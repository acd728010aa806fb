"""More concurrent requests than `max_num_seqs`: the engine's waiting queue fills, continuous
batching serves them all, and each answer equals `LLM.generate` run on its own prompt alone; once
per in-process engine kind (conftest: one process; a 2-stage pipeline as `serve --plan` runs it).

Not over the replica plan's router (the conftest's `replicas` kind, which this test passes): its
start-up (three processes loading the model) is most of a module's time there, and the suite runs the
router under the api, choices, logprobs and metrics modules (concurrent requests on both replicas:
test_server_api)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

MAX_NUM_SEQS = 2
NUM_REQUESTS = 6  # three times the running slots: some requests wait in the engine's queue
TIMEOUT_S = 60.0  # per HTTP request
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "Hello world! How are you",
    "Paged attention stores keys",
    "One two three four",
    "The cat sat on the mat",
]


@pytest.fixture(scope="module", params=("single", "pipeline"))
def engine_kind(request: pytest.FixtureRequest) -> str:
    return request.param


async def _complete(client: httpx.AsyncClient, prompt: str, max_tokens: int, stream: bool) -> str:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if not stream:
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    pieces = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line.removeprefix("data: "))["choices"][0]["text"])
    return "".join(pieces)


def test_more_requests_than_slots_each_equal_llm_generate(
    tiny_model: Path, make_engine: Any, serve_engine: Any, engine_kind: str
) -> None:
    from tessel.engine.llm_engine import LLM
    from tessel.engine.sampling_params import SamplingParams

    lengths = [8 + 5 * i for i in range(NUM_REQUESTS)]  # different lengths: requests leave and join
    llm = LLM(str(tiny_model), max_model_len=256, kv_cache_gib=0.01)
    expected = [
        llm.generate([p], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].text
        for p, n in zip(PROMPTS, lengths, strict=True)
    ]

    async def run(url: str) -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as client:
            jobs = enumerate(zip(PROMPTS, lengths, strict=True))
            calls = [_complete(client, p, n, stream=i % 2 == 0) for i, (p, n) in jobs]
            return await asyncio.gather(*calls)

    with make_engine(max_num_seqs=MAX_NUM_SEQS, max_model_len=256, kv_cache_gib=0.01) as engine:
        with serve_engine(engine, max_pending=NUM_REQUESTS) as served:
            assert asyncio.run(run(served.url)) == expected
            served.wait_idle()  # the engine finished, every KV block back in its pool
    if engine_kind == "single":  # async scheduling (issue 47) runs in one process: the same answers
        overlapped = {"async_scheduling": True}
        with make_engine(
            max_num_seqs=MAX_NUM_SEQS, max_model_len=256, kv_cache_gib=0.01, **overlapped
        ) as engine:
            with serve_engine(engine, max_pending=NUM_REQUESTS) as served:
                assert asyncio.run(run(served.url)) == expected
                served.wait_idle()
            assert engine.num_steps_ahead > 0
