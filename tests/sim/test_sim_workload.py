"""Requests for `--workload`: workload files to length distributions, traces, bundled names."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from tessel.errors import TesselError
from tessel.plan.files.workload import TokenDistribution, parse_workload
from tessel.sim.request_trace import (
    length_distribution,
    lognormal_sigma,
    requests_for_workload,
    requests_from,
)


@pytest.mark.parametrize("trial", range(5))
def test_lognormal_sigma_puts_p99_where_asked(trial: int) -> None:
    rng = np.random.default_rng()
    mean = float(rng.uniform(10, 5000))
    p99 = mean * float(rng.uniform(1.01, 14.0))  # below exp(z^2/2) ~ 15: a solution exists
    sigma = lognormal_sigma(mean, p99)
    mu = math.log(mean) - sigma**2 / 2
    assert stats.lognorm(s=sigma, scale=math.exp(mu)).ppf(0.99) == pytest.approx(p99, rel=1e-9)
    assert stats.lognorm(s=sigma, scale=math.exp(mu)).mean() == pytest.approx(mean, rel=1e-9)


def test_token_distributions_map_to_samplers() -> None:
    rng = np.random.default_rng(1)
    fixed = length_distribution(TokenDistribution(mean=300))
    assert set(fixed.sample(rng, 50)) == {300}
    samples = length_distribution(TokenDistribution(samples=[5, 17, 900]))
    assert set(samples.sample(rng, 300)) == {5, 17, 900}
    tail = length_distribution(TokenDistribution(mean=512, max=2048)).sample(rng, 50_000)
    assert tail.max() <= 2048 and tail.min() >= 1
    assert 0.97 * 512 < tail.mean() < 1.01 * 512  # clipping at max lowers the mean a little
    assert np.percentile(tail, 99) == pytest.approx(2048, rel=0.05)


def test_bundled_workloads_give_requests() -> None:
    online = requests_for_workload("default", 40, seed=2)
    assert len(online.requests) == 40 and online.requests[0].arrival_s == 0.0
    assert online.requests[-1].arrival_s > 0
    batch = requests_for_workload("offline-batch")
    assert len(batch.requests) == 64 and all(r.arrival_s == 0 for r in batch.requests)
    faster = requests_for_workload("default", 40, seed=2, rate_per_s=40.0)
    assert faster.requests[-1].arrival_s < online.requests[-1].arrival_s


def test_rate_override_and_count() -> None:
    workload = parse_workload(
        {"name": "w", "prompt_tokens": 100, "output_tokens": 10, "arrival_rate_per_s": 2.0}
    )
    requests = requests_from(workload, n=2000, seed=5).requests
    gaps = np.diff([r.arrival_s for r in requests])
    assert abs(gaps.mean() - 0.5) < 5 * 0.5 / math.sqrt(len(gaps))
    assert all(r.prompt_tokens == 100 and r.output_tokens == 10 for r in requests)


def test_trace_workloads(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,5,5\n1,6,6\n2,7,7\n")
    assert [r.prompt_tokens for r in requests_for_workload(str(trace), 2).requests] == [5, 6]
    with pytest.raises(TesselError, match="--rate"):
        requests_for_workload(str(trace), rate_per_s=3.0)
    with pytest.raises(TesselError, match="--requests"):
        requests_for_workload(str(trace), 0)
    with pytest.raises(TesselError):
        requests_for_workload(str(tmp_path / "nope.yaml"))
