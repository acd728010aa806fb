"""Requests routed across replica pipelines, and the merged result of simulating each.

`route` sends requests, in arrival order, to replicas by smooth weighted round-robin (nginx's
upstream algorithm): each request raises every replica's credit by its weight and goes to the one
with the most credit, which then pays 1. After any n requests replica r has received n * w_r of
them within one, so a trace splits in the plan's routing weights without randomness.

`merge_results` joins the replicas' simulations into one `SimResult` (stages numbered replica after
replica), so the usual metrics read the whole cluster: latency percentiles over every request,
makespan from the first arrival to the last finish anywhere, utilisation and bubbles over all stages.
"""

from __future__ import annotations

from dataclasses import replace

from tessel.sim.requests import Request
from tessel.sim.simulator import SimResult


def route(requests: list[Request], weights: list[float]) -> list[list[Request]]:
    """The requests each replica gets (see the module docstring)."""
    if not weights or min(weights) <= 0:
        raise ValueError("routing weights must be positive")
    total = float(sum(weights))
    shares = [w / total for w in weights]
    credit = [0.0] * len(shares)
    routed: list[list[Request]] = [[] for _ in shares]
    for request in sorted(requests, key=lambda r: (r.arrival_s, r.id)):
        credit = [c + s for c, s in zip(credit, shares, strict=True)]
        target = max(range(len(credit)), key=credit.__getitem__)
        credit[target] -= 1.0
        routed[target].append(request)
    return routed


def merge_results(results: list[SimResult]) -> SimResult:
    """One result over all replicas (stage indices offset replica after replica)."""
    records, intervals, offset, batches = [], [], 0, 0
    for result in results:
        records.extend(result.records)
        intervals.extend(replace(interval, stage=interval.stage + offset) for interval in result.intervals)
        offset += result.n_stages
        batches += result.batches
    records.sort(key=lambda record: record.request.id)
    intervals.sort(key=lambda interval: interval.start_s)
    return SimResult(offset, tuple(records), tuple(intervals), batches)
