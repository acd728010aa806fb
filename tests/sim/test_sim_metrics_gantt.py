"""Metrics against direct computation from the records, and the Gantt chart files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tessel.chunk.latency import PipelineLatency
from tessel.errors import TesselError
from tessel.sim.gantt import plot_gantt
from tessel.sim.linear import LinearStage
from tessel.sim.requests import LengthDistribution, poisson_requests
from tessel.sim.scheduler import SimSchedulerConfig
from tessel.sim.sim_metrics import Summary, compute_metrics
from tessel.sim.simulator import SimConfig, simulate


def _run(n: int = 40, n_stages: int = 3):
    rng = np.random.default_rng()
    stages = tuple(
        LinearStage(
            prefill_base_s=float(rng.uniform(1e-4, 1e-3)),
            prefill_per_token_s=float(rng.uniform(1e-6, 2e-5)),
            decode_base_s=float(rng.uniform(1e-3, 3e-3)),
            send_latency_s=0.0 if s == n_stages - 1 else 5e-5,
            send_per_token_s=0.0 if s == n_stages - 1 else 1e-7,
        )
        for s in range(n_stages)
    )
    requests = poisson_requests(
        n,
        float(rng.uniform(10, 100)),
        LengthDistribution("uniform", low=16, high=600),
        LengthDistribution("uniform", low=1, high=20),
        seed=int(rng.integers(1 << 30)),
    )
    return simulate(
        PipelineLatency(stages), requests, SimConfig(SimSchedulerConfig(max_num_batched_tokens=256))
    )


def test_metrics_match_the_records() -> None:
    result = _run()
    metrics = compute_metrics(result)
    ttft = [r.first_token_s - r.request.arrival_s for r in result.records]
    tpot = [
        (r.finish_s - r.first_token_s) / (r.request.output_tokens - 1)
        for r in result.records
        if r.request.output_tokens > 1
    ]
    assert metrics.ttft_s.p99 == pytest.approx(np.percentile(ttft, 99))
    assert metrics.ttft_s.mean == pytest.approx(np.mean(ttft))
    assert metrics.tpot_s.p50 == pytest.approx(np.median(tpot))
    makespan = max(r.finish_s for r in result.records) - min(r.request.arrival_s for r in result.records)
    assert metrics.makespan_s == pytest.approx(makespan)
    tokens = sum(r.request.output_tokens for r in result.records)
    assert metrics.throughput_tok_s == pytest.approx(tokens / makespan)
    assert metrics.throughput_req_s == pytest.approx(len(result.records) / makespan)
    busy = [
        sum(i.end_s - i.start_s for i in result.intervals if i.stage == s and i.kind == "compute")
        for s in range(3)
    ]
    assert metrics.stage_busy_s == pytest.approx(busy)
    assert metrics.bubble_fraction == pytest.approx(1 - np.mean(metrics.stage_utilisation))
    assert metrics.ttft_s.p50 <= metrics.ttft_s.p90 <= metrics.ttft_s.p99
    assert set(metrics.to_json()) >= {"ttft_s", "tpot_s", "throughput_tok_s", "bubble_fraction"}


def test_summary_of_nothing_is_nan() -> None:
    assert np.isnan(Summary.of([]).p99)


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_gantt_chart_is_written(tmp_path: Path, suffix: str) -> None:
    result = _run(n=12)
    path = plot_gantt(result, tmp_path / f"chart{suffix}", title="t", stage_labels=["a", "b", "c"])
    data = path.read_bytes()
    if suffix == ".png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        text = data.decode()
        assert "<svg" in text and "stage" not in text.split("<svg", 1)[0]
        assert "request 0" in text  # the legend names the requests
    cut = plot_gantt(result, tmp_path / f"cut{suffix}", until_s=result.intervals[5].end_s)
    assert cut.stat().st_size > 0


def test_gantt_rejects_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(TesselError, match="unknown format"):
        plot_gantt(_run(n=3), tmp_path / "chart.bmp")
