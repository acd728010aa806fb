"""Request generation and trace parsing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tessel.errors import TesselError
from tessel.sim.requests import (
    LengthDistribution,
    Request,
    batch_requests,
    load_trace,
    poisson_requests,
)


def test_poisson_rate_and_lengths() -> None:
    rng = np.random.default_rng()
    rate, n = float(rng.uniform(0.5, 50)), 20_000
    prompt = LengthDistribution("uniform", low=10, high=int(rng.integers(11, 500)))
    output = LengthDistribution("lognormal", mean=100.0, sigma=0.8, low=1, high=4096)
    requests = poisson_requests(n, rate, prompt, output, seed=int(rng.integers(1 << 30)))
    arrivals = np.array([r.arrival_s for r in requests])
    assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0)
    gaps = np.diff(arrivals)
    # exponential gaps: mean 1/rate, standard error (1/rate)/sqrt(n); 5 sigma
    assert abs(gaps.mean() - 1 / rate) < 5 * (1 / rate) / np.sqrt(n - 1)
    prompts = np.array([r.prompt_tokens for r in requests])
    assert prompts.min() >= 10 and prompts.max() <= prompt.high
    outputs = np.array([r.output_tokens for r in requests])
    assert outputs.min() >= 1 and abs(outputs.mean() - 100) < 5


def test_poisson_is_reproducible_by_seed() -> None:
    dist = LengthDistribution("lognormal", mean=64)
    a = poisson_requests(50, 3.0, dist, dist, seed=7)
    b = poisson_requests(50, 3.0, dist, dist, seed=7)
    c = poisson_requests(50, 3.0, dist, dist, seed=8)
    assert a == b and a != c


def test_batch_requests_arrive_together() -> None:
    requests = batch_requests(9, LengthDistribution("fixed", 33), LengthDistribution("fixed", 5))
    assert all(r.arrival_s == 0 and r.prompt_tokens == 33 and r.output_tokens == 5 for r in requests)


def _random_requests(n: int) -> list[Request]:
    rng = np.random.default_rng()
    arrivals = np.sort(rng.uniform(0, 10, n))
    return [
        Request(i, float(arrivals[i]), int(rng.integers(1, 5000)), int(rng.integers(1, 900)))
        for i in range(n)
    ]


def test_csv_and_jsonl_traces_round_trip(tmp_path: Path) -> None:
    requests = _random_requests(40)
    csv_path = tmp_path / "t.csv"
    csv_path.write_text(
        "arrival_s,prompt_tokens,output_tokens\n"
        + "".join(f"{r.arrival_s!r},{r.prompt_tokens},{r.output_tokens}\n" for r in requests)
    )
    jsonl_path = tmp_path / "t.jsonl"
    jsonl_path.write_text(
        "".join(
            json.dumps(
                {"arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}
            )
            + "\n"
            for r in requests
        )
    )
    assert load_trace(csv_path) == requests
    assert load_trace(jsonl_path) == requests


def test_trace_is_sorted_by_arrival(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("output_tokens,arrival_s,prompt_tokens\n3,2.5,10\n4,0.5,20\n")
    requests = load_trace(path)
    assert [r.arrival_s for r in requests] == [0.5, 2.5]
    assert [(r.prompt_tokens, r.output_tokens) for r in requests] == [(20, 4), (10, 3)]


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,abc,5\n", ":3: field 'prompt_tokens'"),
        ("arrival_s,prompt_tokens,output_tokens\n0,10,5\n\n1,10,2.5\n", ":4: field 'output_tokens'"),
        ("arrival_s,prompt_tokens,output_tokens\n-1,10,5\n", ":2: field 'arrival_s'"),
        ("arrival_s,prompt_tokens,output_tokens\nnan,10,5\n", ":2: field 'arrival_s'"),
        ("arrival_s,prompt_tokens,output_tokens\n0,0,5\n", ":2: field 'prompt_tokens'"),
        ("arrival_s,prompt_tokens,output_tokens\n0,10\n", ":2: 2 fields"),
        ("arrival_s,prompt_tokens\n0,10\n", ":1: header lacks output_tokens"),
        ("", "empty file"),
        ("arrival_s,prompt_tokens,output_tokens\n", "holds no requests"),
    ],
)
def test_csv_errors_name_file_line_and_field(tmp_path: Path, body: str, where: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(TesselError, match="bad.csv") as info:
        load_trace(path)
    assert where in str(info.value)


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (
            '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n'
            '{"arrival_s": 1, "prompt_tokens": 5}\n',
            ":2: field 'output_tokens' is missing",
        ),
        ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n{not json\n', ":2: not valid JSON"),
        ("[1, 2, 3]\n", ":1: expected an object"),
        ('{"arrival_s": "soon", "prompt_tokens": 5, "output_tokens": 1}\n', ":1: field 'arrival_s'"),
        ('{"arrival_s": 0, "prompt_tokens": true, "output_tokens": 1}\n', ":1: field 'prompt_tokens'"),
        ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": -3}\n', ":1: field 'output_tokens'"),
    ],
)
def test_jsonl_errors_name_file_line_and_field(tmp_path: Path, body: str, where: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(body)
    with pytest.raises(TesselError, match="bad.jsonl") as info:
        load_trace(path)
    assert where in str(info.value)


def test_missing_file_and_unknown_extension(tmp_path: Path) -> None:
    with pytest.raises(TesselError, match="does not exist"):
        load_trace(tmp_path / "nope.csv")
    path = tmp_path / "trace.txt"
    path.write_text("x")
    with pytest.raises(TesselError, match="unknown extension"):
        load_trace(path)


def test_generators_reject_bad_arguments() -> None:
    dist = LengthDistribution()
    with pytest.raises(TesselError):
        poisson_requests(0, 1.0, dist, dist)
    with pytest.raises(TesselError):
        poisson_requests(5, 0.0, dist, dist)
    with pytest.raises(ValueError):
        LengthDistribution("zipf")


def test_a_json_integer_beyond_any_float_is_a_user_error(tmp_path) -> None:
    """Found by tests/cli/test_fuzz_readers.py: float(10**400) raises OverflowError."""
    from tessel.errors import TesselError
    from tessel.sim.requests import load_trace

    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_s": 1' + "0" * 400 + ', "prompt_tokens": 1, "output_tokens": 1}\n')
    with pytest.raises(TesselError, match="field 'arrival_s' must be a number"):
        load_trace(path)
