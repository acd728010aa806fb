"""What a simulation says about a plan: latency percentiles, throughput, stage use and bubbles.

Definitions (all times in seconds):
- TTFT of a request = first token leaves the last stage - arrival.
- TPOT of a request = (finish - first token) / (output_tokens - 1); one-token requests have none.
- makespan = last finish - first arrival; throughput = generated tokens (or requests) / makespan.
- busy_s of a stage = total length of its compute intervals (sends run beside compute, not counted).
- span = [first compute start on any stage, last compute end on any stage];
  utilisation of a stage = busy_s / span; bubble fraction = (S * span - sum_s busy_s) / (S * span),
  i.e. the share of the S x span stage-time rectangle that no stage spends computing.
  For m equal chunks on S equal stages with no send time it is (S-1)/(m+S-1). Under light load
  the idle time between requests counts as bubble too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from tessel.sim.simulator import SimResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class Summary:
    """p50, p90, p99 and mean of one latency (seconds); NaN when there are no samples."""

    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: list[float]) -> Summary:
        if not values:
            nan = float("nan")
            return cls(nan, nan, nan, nan)
        p50, p90, p99 = (float(v) for v in np.percentile(values, PERCENTILES))
        return cls(p50, p90, p99, float(np.mean(values)))


@dataclass(frozen=True, slots=True)
class Metrics:
    requests: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: Summary
    tpot_s: Summary
    e2e_s: Summary  # finish - arrival
    makespan_s: float
    throughput_tok_s: float  # generated tokens / makespan
    throughput_req_s: float
    stage_busy_s: tuple[float, ...]
    stage_utilisation: tuple[float, ...]
    bubble_fraction: float
    span_s: float
    batches: int

    def to_json(self) -> dict:
        return asdict(self)


def compute_metrics(result: SimResult) -> Metrics:
    records = result.records
    first_arrival = min(record.request.arrival_s for record in records)
    makespan = max(record.finish_s for record in records) - first_arrival
    output_tokens = sum(record.request.output_tokens for record in records)
    busy = [0.0] * result.n_stages
    starts, ends = [], []
    for interval in result.intervals:
        if interval.kind == "compute":
            busy[interval.stage] += interval.end_s - interval.start_s
            starts.append(interval.start_s)
            ends.append(interval.end_s)
    span = max(ends) - min(starts) if starts else 0.0
    utilisation = tuple(b / span if span > 0 else 0.0 for b in busy)
    area = result.n_stages * span
    bubble = (area - sum(busy)) / area if span > 0 else 0.0
    tpots = [record.tpot_s for record in records if record.tpot_s is not None]
    return Metrics(
        requests=len(records),
        prompt_tokens=sum(record.request.prompt_tokens for record in records),
        output_tokens=output_tokens,
        ttft_s=Summary.of([record.ttft_s for record in records]),
        tpot_s=Summary.of(tpots),  # type: ignore[arg-type]
        e2e_s=Summary.of([record.finish_s - record.request.arrival_s for record in records]),
        makespan_s=makespan,
        throughput_tok_s=output_tokens / makespan if makespan > 0 else float("inf"),
        throughput_req_s=len(records) / makespan if makespan > 0 else float("inf"),
        stage_busy_s=tuple(busy),
        stage_utilisation=utilisation,
        bubble_fraction=bubble,
        span_s=span,
        batches=result.batches,
    )
