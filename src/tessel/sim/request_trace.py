"""The requests of `tessel simulate --workload W`: a trace file, or draws from a workload file.

A workload (`tessel.plan.files.workload`, bundled name or YAML) gives length distributions and either an
arrival rate (Poisson arrivals) or a batch size (that many requests at t = 0). Its lengths become:

- `samples`: drawn uniformly from the samples;
- a mean alone: that length for every request;
- a mean with p99 and/or max: lognormal with that mean, its sigma chosen so that the 99th
  percentile is p99 (or max when only max is given), and draws clipped to max. Solving
  exp(mu + z*sigma) = p99 with mu = ln(mean) - sigma^2/2 gives sigma = z - sqrt(z^2 - 2 ln(p99/mean)),
  z = 2.326; when p99/mean exceeds exp(z^2/2) (no solution) sigma = z. Clipping lowers the mean a
  little.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tessel.errors import TesselError
from tessel.plan.files.workload import TokenDistribution, Workload, load_workload, lognormal_sigma
from tessel.sim.requests import (
    LengthDistribution,
    Request,
    batch_requests,
    load_trace,
    poisson_requests,
)

TRACE_SUFFIXES = (".csv", ".jsonl", ".json", ".ndjson")
DEFAULT_REQUESTS = 200
# Most requests one simulation serves: every request keeps its record and intervals in memory
# (at this many, a run of the default plan takes minutes and gigabytes: docs/results.md, Limits).
MAX_REQUESTS = 20_000


@dataclass(frozen=True, slots=True)
class RequestSet:
    requests: list[Request]
    description: str  # for reports: where the requests came from


def requests_for_workload(
    spec: str, n: int | None = None, seed: int = 0, rate_per_s: float | None = None
) -> RequestSet:
    """Requests for a trace path, a workload YAML or a bundled workload name."""
    if n is not None and not 1 <= n <= MAX_REQUESTS:
        raise TesselError(f"--requests must be from 1 to {MAX_REQUESTS}, got {n}")
    if rate_per_s is not None and not rate_per_s > 0:
        raise TesselError(f"--rate must be > 0 requests/s, got {rate_per_s}")
    path = Path(spec)
    if path.suffix.lower() in TRACE_SUFFIXES:
        requests = load_trace(path)
        if n is not None:
            requests = requests[:n]
        if rate_per_s is not None:
            raise TesselError("--rate applies to workload files, not to traces (their arrivals are given)")
        _check_count(len(requests), f"trace {path}")
        return RequestSet(requests, f"trace {path} ({len(requests)} requests)")
    return requests_from(load_workload(spec), n, seed, rate_per_s)


def requests_from(
    workload: Workload, n: int | None = None, seed: int = 0, rate_per_s: float | None = None
) -> RequestSet:
    prompt, output = length_distribution(workload.prompt_tokens), length_distribution(workload.output_tokens)
    rate = rate_per_s if rate_per_s is not None else workload.arrival_rate_per_s
    if rate is None:  # offline batch
        count = n if n is not None else workload.batch_size
        _check_count(count, f"workload {workload.name} (batch_size)")
        requests = batch_requests(count, prompt, output, seed)
        return RequestSet(requests, f"{workload.name}: batch of {count} requests at t=0, seed {seed}")
    count = n if n is not None else DEFAULT_REQUESTS
    requests = poisson_requests(count, rate, prompt, output, seed)
    return RequestSet(requests, f"{workload.name}: {count} Poisson requests at {rate:g}/s, seed {seed}")


def _check_count(count: int, source: str) -> None:
    if count > MAX_REQUESTS:
        raise TesselError(
            f"{source}: {count} requests; a simulation serves at most {MAX_REQUESTS} "
            f"(pass --requests {MAX_REQUESTS} or fewer)"
        )


def length_distribution(tokens: TokenDistribution) -> LengthDistribution:
    if tokens.samples is not None:
        samples = tuple(int(s) for s in tokens.samples)
        return LengthDistribution("samples", mean=tokens.mean_tokens, high=max(samples), samples=samples)
    mean = float(tokens.mean)
    tail = tokens.p99 if tokens.p99 is not None else tokens.max
    if tail is None or tail <= mean:
        return LengthDistribution("fixed", mean=mean, high=max(1, round(mean)))
    high = tokens.max if tokens.max is not None else 1 << 20
    return LengthDistribution("lognormal", mean=mean, sigma=lognormal_sigma(mean, tail), high=high)
