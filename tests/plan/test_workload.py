"""Workload files and the quantities the planner derives from them."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from tessel.errors import TesselError
from tessel.plan.files.workload import NOMINAL_TPOT_S, list_bundled_workloads, load_workload, parse_workload


def test_bundled_workloads() -> None:
    names = list_bundled_workloads()
    assert {"default", "long-prompt", "offline-batch"} <= set(names)
    for name in names:
        workload = load_workload(name)
        assert 1 <= workload.micro_batches <= workload.max_micro_batch
        assert 0 < workload.alpha_r <= 1
    assert (
        load_workload("long-prompt").prompt_tokens.mean_tokens
        > 4 * load_workload("default").prompt_tokens.mean_tokens
    )


def test_offline_batch_derivation() -> None:
    batch, cap = random.randint(1, 200), random.randint(1, 16)
    workload = parse_workload(
        {
            "name": "w",
            "prompt_tokens": 100,
            "output_tokens": {"mean": 20, "max": 50},
            "batch_size": batch,
            "max_micro_batch": cap,
        }
    )
    m = min(batch, cap)
    assert workload.requests_in_flight == batch
    assert workload.micro_batches == m
    assert workload.micro_batch_size == math.ceil(batch / m)
    assert workload.micro_batches * workload.micro_batch_size >= batch
    assert workload.alpha_f == (math.inf if m == 1 else 1 / (m - 1))
    assert workload.max_kv_tokens == 150
    assert workload.alpha_r == pytest.approx(120 / 150)
    assert workload.mean_decode_context_tokens == pytest.approx(110)


def test_littles_law_for_a_request_stream() -> None:
    rate, output = random.uniform(0.1, 20), random.randint(10, 500)
    workload = parse_workload(
        {
            "name": "w",
            "prompt_tokens": 64,
            "output_tokens": output,
            "arrival_rate_per_s": rate,
            "max_micro_batch": 1000,
        }
    )
    assert workload.requests_in_flight == max(1, math.ceil(rate * output * NOMINAL_TPOT_S))
    explicit = parse_workload(
        {
            "name": "w",
            "prompt_tokens": 64,
            "output_tokens": output,
            "arrival_rate_per_s": 2,
            "latency_estimate_s": 3.5,
        }
    )
    assert explicit.requests_in_flight == 7


def test_samples_give_mean_and_max() -> None:
    samples = [random.randint(1, 4000) for _ in range(random.randint(1, 50))]
    workload = parse_workload(
        {"name": "w", "prompt_tokens": {"samples": samples}, "output_tokens": 8, "batch_size": 1}
    )
    assert workload.prompt_tokens.mean_tokens == pytest.approx(sum(samples) / len(samples))
    assert workload.max_kv_tokens == max(samples) + 8
    assert workload.alpha_f == math.inf  # one request: nothing to pipeline


def test_p99_is_used_when_no_max() -> None:
    workload = parse_workload(
        {"name": "w", "prompt_tokens": {"mean": 100, "p99": 900}, "output_tokens": 1, "batch_size": 1}
    )
    assert workload.prompt_tokens.max_tokens == 900


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"batch_size": 4, "arrival_rate_per_s": 1}, "exactly one"),
        ({}, "exactly one"),
        ({"batch_size": 4, "prompt_tokens": {"mean": 500, "max": 100}}, "mean <= p99 <= max"),
        ({"batch_size": 4, "prompt_tokens": {"p99": 100}}, "needs a mean"),
        ({"batch_size": 4, "prompt_tokens": {"samples": [3], "mean": 3}}, "not both"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 4, "latency_estimate_s": 2}, "latency_estimate_s"),
    ],
)
def test_invalid_workloads(fields: dict, needle: str) -> None:
    data = {"name": "w", "prompt_tokens": 10, "output_tokens": 10} | fields
    with pytest.raises(TesselError, match=needle):
        parse_workload(data)


def test_file_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(
        "name: w\nprompt_tokens: 10\noutput_tokens:\n  mean: -3\nbatch_size: 2\nmax_micro_batchs: 3\n"
    )
    with pytest.raises(TesselError) as info:
        load_workload(path)
    message = str(info.value)
    assert f"{path}:4: output_tokens.mean" in message
    assert f"{path}:6: max_micro_batchs: unknown field" in message and "max_micro_batch" in message
    with pytest.raises(TesselError, match="default"):
        load_workload("no-such-workload")
