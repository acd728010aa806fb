"""Paths that share a device (a flow plan's) queue on its one timeline."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from tessel.chunk.latency import PipelineLatency
from tessel.sim.linear import LinearStage
from tessel.sim.requests import LengthDistribution, Request, poisson_requests
from tessel.sim.shared_devices import SharedPath, simulate_shared
from tessel.sim.simulator import SimConfig, simulate


def _stage(rng: np.random.Generator, last: bool) -> LinearStage:
    return LinearStage(
        prefill_base_s=float(rng.uniform(1e-4, 2e-3)),
        prefill_per_token_s=float(rng.uniform(1e-6, 5e-5)),
        attention_s=0.0,
        decode_base_s=float(rng.uniform(1e-4, 3e-3)),
        decode_per_seq_s=float(rng.uniform(0, 1e-5)),
        decode_per_context_s=0.0,
        send_latency_s=0.0 if last else float(rng.uniform(0, 2e-4)),
        send_per_token_s=0.0,
    )


def _pipeline(rng: np.random.Generator, n: int) -> PipelineLatency:
    return PipelineLatency(tuple(_stage(rng, s == n - 1) for s in range(n)))


def test_one_device_serves_two_paths_one_after_the_other() -> None:
    pipeline = _pipeline(np.random.default_rng(0), 1)
    alone = simulate(pipeline, [Request(0, 0.0, 300, 1)], SimConfig()).records[0].finish_s
    paths = [SharedPath(pipeline, SimConfig(), [Request(i, 0.0, 300, 1)], ("gpu0",)) for i in range(2)]
    finishes = sorted(r.records[0].finish_s for r in simulate_shared(paths))
    assert finishes == pytest.approx([alone, 2 * alone], rel=1e-12)


def test_paths_on_their_own_devices_run_as_separate_pipelines() -> None:
    rng = np.random.default_rng(1)
    prompt, output = LengthDistribution("fixed", 200), LengthDistribution("fixed", 8)
    paths = []
    for p in range(2):
        requests = poisson_requests(30, 5.0, prompt, output, seed=p)
        devices = tuple(f"d{p}{s}" for s in range(3))
        paths.append(SharedPath(_pipeline(rng, 3), SimConfig(), requests, devices))
    for path, shared in zip(paths, simulate_shared(paths), strict=True):
        alone = simulate(path.pipeline, path.requests, path.config)
        assert [r.finish_s for r in shared.records] == pytest.approx([r.finish_s for r in alone.records])


def test_a_shared_device_computes_one_batch_at_a_time() -> None:
    rng = np.random.default_rng(2)
    first = _pipeline(rng, 2)
    prompt, output = LengthDistribution("fixed", 100), LengthDistribution("uniform", low=1, high=20)
    devices = (("a", "shared"), ("b", "shared"), ("shared", "c"))
    paths = []
    for p in range(3):
        requests = poisson_requests(40, 20.0, prompt, output, seed=p)
        paths.append(SharedPath(first if p == 0 else _pipeline(rng, 2), SimConfig(), requests, devices[p]))
    results = simulate_shared(paths)
    busy = defaultdict(list)
    for path, result in zip(paths, results, strict=True):
        assert all(r.finish_s >= r.request.arrival_s for r in result.records)
        for interval in result.intervals:
            if interval.kind == "compute":
                busy[path.devices[interval.stage]].append((interval.start_s, interval.end_s))
    spans = sorted(busy["shared"])
    assert len(spans) > 40
    assert all(a_end <= b_start + 1e-12 for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
