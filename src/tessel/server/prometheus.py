"""Prometheus metrics of the server (`GET /metrics`), under vLLM's names with the `tessel:` prefix.

Gauges are read from the engine when scraped (requests running / waiting, KV blocks total / used
and their usage fraction); counters and histograms are fed by the engine thread after every step
(`ServerMetrics.observe`): prompt and generation tokens, finished requests by reason, time to
first token, inter-token latency and end-to-end latency. Each app has its own registry, so two
servers in one process do not share counts.

vLLM's names: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
(a fraction in [0, 1] despite its name), `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`,
`vllm:request_success_total{finished_reason}`, `vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`. KV block counts have no
vLLM gauge; they are `tessel:num_kv_blocks_total` and `tessel:num_kv_blocks_used`.

Preemptions (an engine with `preemption_stats`, `tessel.engine.preemption.PreemptionStats`), read
at scrape time: `tessel:num_preemptions_total{mode}` (mode "swap" or "recompute"; vLLM's
`vllm:num_preemptions_total` has no mode), `tessel:kv_swap_bytes_total{direction}` ("to_host",
"to_device") and `tessel:kv_swap_fallbacks_total` (swaps that found the host pool full and
recomputed instead).

A pipeline engine's supervisor (`tessel serve --plan`) adds, per stage,
`tessel:stage_up{stage,device}` (1 while its process runs) and
`tessel:stage_heartbeat_age_seconds{stage}` (stages after the first: seconds since its heartbeat).

A pipeline server's remap watcher (`RemapCollector`, `tessel.pipeline.supervision.remap_watch`) adds
`tessel:stage_step_seconds{stage,device,source}` (source "measured": mean busy seconds per
micro-batch over the watch window; "predicted": the plan's), `tessel:workload{quantity,source}`
(arrival_rate_per_s, mean_prompt_tokens, mean_output_tokens; measured or planned) and, with
`--remap auto`, `tessel:remap_decisions_total{outcome}` (every evaluation, taken or not).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "tessel:"
# vLLM's bucket bounds (vllm/engine/metrics.py), in seconds
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class _EngineGauges(Collector):
    """Read at scrape time; the engine thread may be mid-step, which only makes a gauge a step old."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        scheduler = self.engine.scheduler
        total = self.engine.num_total_blocks
        used = total - self.engine.num_free_blocks
        yield GaugeMetricFamily(f"{PREFIX}num_requests_running", "Requests running.", len(scheduler.running))
        yield GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Requests waiting.", len(scheduler.waiting))
        yield GaugeMetricFamily(f"{PREFIX}num_kv_blocks_total", "KV cache blocks in the pool.", total)
        yield GaugeMetricFamily(f"{PREFIX}num_kv_blocks_used", "KV cache blocks held by requests.", used)
        yield GaugeMetricFamily(
            f"{PREFIX}kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).", used / total
        )
        stats = getattr(self.engine, "preemption_stats", None)
        if stats is not None:
            yield from _preemption_families(stats)
        supervisor = getattr(self.engine, "supervisor", None)
        if supervisor is not None:
            yield from _stage_families(supervisor.stage_gauges())


def _preemption_families(stats: Any) -> Iterator[CounterMetricFamily]:
    by_mode = CounterMetricFamily(
        f"{PREFIX}num_preemptions", "Preemptions, by what the KV blocks got.", labels=["mode"]
    )
    by_mode.add_metric(["swap"], stats.swaps)
    by_mode.add_metric(["recompute"], stats.recomputes)
    moved = CounterMetricFamily(
        f"{PREFIX}kv_swap_bytes", "KV bytes copied between device and host pool.", labels=["direction"]
    )
    moved.add_metric(["to_host"], stats.bytes_to_host)
    moved.add_metric(["to_device"], stats.bytes_to_device)
    yield by_mode
    yield moved
    yield CounterMetricFamily(
        f"{PREFIX}kv_swap_fallbacks", "Swaps that found the host pool full.", stats.swap_fallbacks
    )


def _stage_families(stages: list[Any]) -> Iterator[GaugeMetricFamily]:
    up = GaugeMetricFamily(
        f"{PREFIX}stage_up", "1 while the pipeline stage's process runs.", labels=["stage", "device"]
    )
    age = GaugeMetricFamily(
        f"{PREFIX}stage_heartbeat_age_seconds", "Seconds since the stage's last heartbeat.", labels=["stage"]
    )
    for stage in stages:
        up.add_metric([str(stage.stage), stage.device], 1.0 if stage.up else 0.0)
        if stage.heartbeat_age_s is not None:
            age.add_metric([str(stage.stage)], stage.heartbeat_age_s)
    yield up
    yield age


class RemapCollector(Collector):
    """The remap watcher's measured-beside-predicted gauges and decision counts, read at scrape time."""

    def __init__(self, watch: Any) -> None:
        self.watch = watch

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        step = GaugeMetricFamily(
            f"{PREFIX}stage_step_seconds",
            "Seconds per micro-batch of a pipeline stage: measured over the watch window, or the plan's.",
            labels=["stage", "device", "source"],
        )
        for stage in self.watch.stage_steps():
            step.add_metric([str(stage.stage), stage.device, "predicted"], stage.predicted_s)
            if stage.measured_s is not None:
                step.add_metric([str(stage.stage), stage.device, "measured"], stage.measured_s)
        yield step
        load = GaugeMetricFamily(
            f"{PREFIX}workload", "The workload: measured over the watch window, or the plan's.",
            labels=["quantity", "source"],
        )  # fmt: skip
        for quantity, (measured, planned) in self.watch.workload().items():
            for source, value in (("measured", measured), ("planned", planned)):
                if value is not None:
                    load.add_metric([quantity, source], value)
        yield load
        if self.watch.decider is not None:
            decisions = CounterMetricFamily(
                f"{PREFIX}remap_decisions", "Remap decisions by outcome.", labels=["outcome"]
            )
            for outcome, count in self.watch.decisions.items():
                decisions.add_metric([outcome], count)
            yield decisions


class ServerMetrics:
    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineGauges(engine))
        r = self.registry
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of requests.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(
            f"{PREFIX}request_success", "Finished requests.", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS_S, registry=r
        )
        self.itl = Histogram(
            f"{PREFIX}inter_token_latency_seconds", "Time between tokens.", buckets=ITL_BUCKETS_S, registry=r
        )
        self.e2e = Histogram(
            f"{PREFIX}e2e_request_latency_seconds", "Arrival to finish.", buckets=E2E_BUCKETS_S, registry=r
        )
        self._last_token_s: dict[str, float] = {}  # engine thread only

    def observe(self, outputs: list[Any], now_s: float) -> None:
        """Count one step's outputs (engine thread); `now_s` is time.time(), the clock of RequestMetrics."""
        for out in outputs:
            rid = out.request_id
            if out.new_token_ids:
                self.generation_tokens.inc(len(out.new_token_ids))
                last = self._last_token_s.get(rid)
                if last is None:
                    self.prompt_tokens.inc(out.num_prompt_tokens)
                    self.ttft.observe(max(now_s - out.metrics.arrival_time, 0.0))
                else:
                    self.itl.observe(max(now_s - last, 0.0))
                self._last_token_s[rid] = now_s
            if out.finished:
                self._last_token_s.pop(rid, None)
                self.request_success.labels(finished_reason=out.finish_reason or "unknown").inc()
                self.e2e.observe(max(now_s - out.metrics.arrival_time, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
