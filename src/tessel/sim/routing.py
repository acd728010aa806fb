"""Requests routed across replica pipelines, and the merged result of simulating each.

`route` sends requests, in arrival order, to replicas by their weights in turn, without randomness
(`tessel.plan.replicas.weighted_turns`, Tijdeman's chairman assignment): after any n requests replica r has
received n * w_r of them within 1 - 1/(2m - 2) (m replicas), so a trace splits in the plan's routing
weights; on a short trace a replica of small weight may get none.

`merge_results` joins the replicas' simulations into one `SimResult` (stages numbered replica after
replica), so the usual metrics read the whole cluster: latency percentiles over every request,
makespan from the first arrival to the last finish anywhere, utilisation and bubbles over all stages.
"""

from __future__ import annotations

from dataclasses import replace

from tessel.plan.replicas.weighted_turns import WeightedTurns
from tessel.sim.requests import Request
from tessel.sim.simulator import SimResult


def route(requests: list[Request], weights: list[float]) -> list[list[Request]]:
    """The requests each replica gets (see the module docstring)."""
    turns = WeightedTurns(weights)  # refuses weights that are not all positive
    routed: list[list[Request]] = [[] for _ in weights]
    for request in sorted(requests, key=lambda r: (r.arrival_s, r.id)):
        routed[turns.next()].append(request)
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
