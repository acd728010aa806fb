"""Serving regimes: the scheduler settings a simulation starts from, before any flag overrides them.

- `plan`: the regime the planner priced. Its objective `sum T + (m - 1) max T` assumes m
  micro-batches in flight, each of b requests, KV reserved for all m x b of them. So the
  simulator pins each request to one of m slots (vLLM V0's virtual engines), admits at most m x b
  sequences, and only while their KV fits the plan's `kv_gib` (where every stage gives one).
  A plan file without `workload.m` / `workload.micro_batch_size` falls back to `continuous`.
- `continuous`: one shared pool as vLLM V1 schedules it: up to 256 sequences, at most one
  micro-batch per stage in flight, no KV limit. A sequence can be in one micro-batch at a time, so
  when every running decode fits one token budget, the pipeline carries a single decode batch and
  its latency (sum of stage times), not its bottleneck, sets the throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.plan.files.plan_file import PlanFile
from tessel.sim.scheduler import DEFAULT_MAX_NUM_SEQS

REGIMES = ("plan", "continuous")


@dataclass(frozen=True, slots=True)
class RegimeDefaults:
    max_num_seqs: int
    max_in_flight: int | None  # None: one micro-batch per stage
    pinned: bool
    kv_limit: bool  # limit admission to the plan's kv_gib where its stages give one


def regime_defaults(plan: PlanFile, regime: str) -> RegimeDefaults:
    continuous = RegimeDefaults(DEFAULT_MAX_NUM_SEQS, None, False, False)
    if regime == "continuous":
        return continuous
    workload = plan.workload
    if not isinstance(workload, dict):
        return continuous
    m, b = workload.get("m"), workload.get("micro_batch_size")
    if not (isinstance(m, int) and isinstance(b, int) and m >= 1 and b >= 1):
        return continuous
    return RegimeDefaults(max_num_seqs=m * b, max_in_flight=m, pinned=m > 1, kv_limit=True)
