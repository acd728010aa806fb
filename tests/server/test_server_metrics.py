"""`GET /metrics` (issue 15): vLLM's metric names under `tessel:`, scraped around a disconnect storm.

A live server, once per engine kind (conftest: one process; a 2-stage pipeline as `serve --plan` runs
it, whose /metrics was a 500: issue 27; the router of a 2-replica plan, issue 29). Oracles: the
engine's own counters (running / waiting queues, free blocks) while it is parked, the usage fields
of a finished response for the token counters, and zero KV blocks in use after every client of the
storm has gone.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import httpx
import pytest

prometheus_parser = pytest.importorskip("prometheus_client.parser")

MAX_NUM_SEQS = 4
STORM = 6  # more streams than MAX_NUM_SEQS: some run, some wait
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def engine(make_engine: Any) -> Any:
    with make_engine(max_num_seqs=MAX_NUM_SEQS, max_model_len=512, kv_cache_gib=0.02) as engine:
        yield engine


@pytest.fixture(scope="module")
def served(engine: Any, serve_engine: Any) -> Any:
    with serve_engine(engine, max_pending=16) as served:
        yield served


@pytest.fixture(scope="module")
def app(served: Any) -> Any:
    return served.app  # in-process kinds (tests marked in_process_engine)


@pytest.fixture(scope="module")
def base_url(served: Any) -> str:
    return served.url


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value for every sample of /metrics."""
    response = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in prometheus_parser.text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def test_metrics_use_vllm_names(base_url: str, engine_kind: str) -> None:
    """Each of vLLM's names is a sample of /metrics; behind the router (the replicas kind, conftest:
    a plan of two replicas), one per replica, labelled `replica="K"`."""
    samples = set(scrape(base_url))
    labels = ['{replica="0"}', '{replica="1"}'] if engine_kind == "replicas" else [""]
    for name in [
        "tessel:num_requests_running",
        "tessel:num_requests_waiting",
        "tessel:num_kv_blocks_total",
        "tessel:num_kv_blocks_used",
        "tessel:kv_cache_usage_perc",
        "tessel:prompt_tokens_total",
        "tessel:generation_tokens_total",
        "tessel:time_to_first_token_seconds_count",
        "tessel:inter_token_latency_seconds_count",
        "tessel:e2e_request_latency_seconds_count",
    ]:
        for label in labels:
            assert name + label in samples, sorted(samples)


@pytest.mark.in_process_engine
def test_kv_blocks_return_to_zero_after_a_disconnect_storm(
    base_url: str, app: Any, engine: Any, wait_until: Any, engine_paused: Any
) -> None:
    before = scrape(base_url)
    assert before["tessel:num_kv_blocks_total"] == engine.num_total_blocks
    done = httpx.post(
        f"{base_url}/v1/completions",
        json={"prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
        timeout=TIMEOUT_S,
    ).json()
    async_engine = app.state.async_engine
    body = {"prompt": "Once upon a time", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    with ExitStack() as storm:
        for i in range(STORM):
            client = storm.enter_context(httpx.Client(base_url=base_url, timeout=TIMEOUT_S))
            prompt = {**body, "prompt": f"{body['prompt']} {i}", "stream": True}
            storm.enter_context(client.stream("POST", "/v1/completions", json=prompt))
        wait_until(lambda: async_engine.num_pending == STORM, "the storm's requests to be queued")
        with engine_paused(async_engine):
            during = scrape(base_url)
            assert during["tessel:num_requests_running"] == len(engine.scheduler.running) == MAX_NUM_SEQS
            assert (
                during["tessel:num_requests_waiting"] == len(engine.scheduler.waiting) == STORM - MAX_NUM_SEQS
            )
            used = engine.num_total_blocks - engine.num_free_blocks
            assert during["tessel:num_kv_blocks_used"] == used > 0
            assert during["tessel:kv_cache_usage_perc"] == pytest.approx(used / engine.num_total_blocks)
    # every client of the storm has disconnected
    wait_until(lambda: async_engine.num_pending == 0, "the server to notice the disconnects")
    wait_until(lambda: engine.num_free_blocks == engine.num_total_blocks, "the KV blocks to return")
    after = scrape(base_url)
    assert after["tessel:num_kv_blocks_used"] == 0 and after["tessel:kv_cache_usage_perc"] == 0
    assert after["tessel:num_requests_running"] == after["tessel:num_requests_waiting"] == 0

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew('tessel:request_success_total{finished_reason="abort"}') == STORM
    assert grew('tessel:request_success_total{finished_reason="length"}') == 1
    assert grew("tessel:generation_tokens_total") >= done["usage"]["completion_tokens"]
    assert grew("tessel:prompt_tokens_total") >= done["usage"]["prompt_tokens"]
    assert grew("tessel:e2e_request_latency_seconds_count") == STORM + 1
    assert grew("tessel:time_to_first_token_seconds_count") >= 1
    assert grew("tessel:inter_token_latency_seconds_count") >= done["usage"]["completion_tokens"] - 1
