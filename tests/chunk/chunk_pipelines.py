"""Random pipelines and a brute force over every chunking, shared by the chunk tests."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from tessel.chunk.latency import PipelineLatency
from tessel.chunk.schedule import makespan_naive
from tessel.chunk.stages import PolynomialStage
from tessel.cost.profile import PrefillFit


@dataclass(frozen=True)
class RooflineStage:
    """A stage with only the scalar protocol: max(compute, memory) + overhead, like the cost model."""

    flops_per_token: float
    attn_per_pair: float
    weight_s: float
    overhead_s: float
    send_s_per_token: float

    def prefill_time_s(self, chunk_tokens: int, offset_tokens: int) -> float:
        c, p = chunk_tokens, offset_tokens
        compute = self.flops_per_token * c + self.attn_per_pair * c * (p + c / 2)
        return max(compute, self.weight_s) + self.overhead_s

    def decode_time_s(self, batch_size: int, sum_context_tokens: int) -> float:
        return self.weight_s + self.attn_per_pair * sum_context_tokens

    def send_time_s(self, tokens: int) -> float:
        return self.send_s_per_token * tokens


def random_fit(rng: np.random.Generator) -> PrefillFit:
    return PrefillFit(
        a0=float(rng.uniform(0.0, 2e-3)),
        a1=float(rng.uniform(0.2, 2.0) * 1e-5),
        a2=float(rng.uniform(0.0, 1.0) * 1e-8),
        a3=float(rng.uniform(0.0, 1.0) * 1e-7),
    )


def uniform_pipeline(rng: np.random.Generator, n_stages: int) -> PipelineLatency:
    fit = random_fit(rng)
    layers = float(rng.integers(1, 6))
    latency, per_token = float(rng.uniform(0, 5e-4)), float(rng.uniform(0, 2e-6))
    middle = PolynomialStage(fit, layers, send_latency_s=latency, send_s_per_token=per_token)
    last = PolynomialStage(fit, layers)
    return PipelineLatency(tuple([middle] * (n_stages - 1) + [last]))


def mixed_pipeline(rng: np.random.Generator, n_stages: int, scalar_only: bool = False) -> PipelineLatency:
    stages = []
    for s in range(n_stages):
        send = (float(rng.uniform(0, 5e-4)), float(rng.uniform(0, 2e-6))) if s < n_stages - 1 else (0.0, 0.0)
        if scalar_only:
            stages.append(
                RooflineStage(
                    flops_per_token=float(rng.uniform(0.2, 2.0) * 1e-5),
                    attn_per_pair=float(rng.uniform(0.0, 1.0) * 1e-7),
                    weight_s=float(rng.uniform(0.0, 2e-3)),
                    overhead_s=float(rng.uniform(0.0, 5e-4)),
                    send_s_per_token=send[1],
                )
            )
        else:
            stages.append(
                PolynomialStage(
                    random_fit(rng),
                    float(rng.integers(1, 6)),
                    send_latency_s=send[0],
                    send_s_per_token=send[1],
                )
            )
    return PipelineLatency(tuple(stages))


def naive_makespan(pipeline: PipelineLatency, chunks: list[int], seq_lens: list[int]) -> float:
    """Scalar calls and the loop recurrence: independent of the vectorised code under test."""
    times = np.zeros((pipeline.n_stages, len(chunks)))
    sends = np.zeros_like(times)
    bounds = np.cumsum([0, *seq_lens])
    done = 0
    for i, c in enumerate(chunks):
        request_start = bounds[np.searchsorted(bounds, done, side="right") - 1]
        for s, stage in enumerate(pipeline.stages):
            times[s, i] = stage.prefill_time_s(c, done - request_start)
            if s < pipeline.n_stages - 1:
                sends[s, i] = stage.send_time_s(c)
        done += c
    return makespan_naive(times, sends)


def all_chunkings(seq_lens: list[int], grid: int, max_chunk: int | None = None):
    """Every chunking whose boundaries lie on each request's grid (chunks never span requests)."""
    per_request = []
    for length in seq_lens:
        cuts = list(range(grid, length, grid))
        options = []
        for mask in itertools.product((False, True), repeat=len(cuts)):
            chosen = [0] + [cut for cut, keep in zip(cuts, mask, strict=True) if keep] + [length]
            chunks = list(np.diff(chosen).astype(int))
            if max_chunk is None or max(chunks) <= max_chunk:
                options.append(chunks)
        per_request.append(options)
    for combo in itertools.product(*per_request):
        yield [c for chunks in combo for c in chunks]


def brute_force(pipeline: PipelineLatency, seq_lens: list[int], grid: int, max_chunk: int | None = None):
    best, best_chunks = np.inf, None
    for chunks in all_chunkings(seq_lens, grid, max_chunk):
        value = naive_makespan(pipeline, chunks, seq_lens)
        if value < best:
            best, best_chunks = value, chunks
    return best, best_chunks
