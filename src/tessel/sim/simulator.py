"""The discrete-event simulator: requests, a scheduler and a pipeline of stages on one event heap.

Each stage is a resource that computes one micro-batch at a time; stages take micro-batches in the
order they entered the pipeline (a permutation flow shop, so chunk i of a prompt always follows
chunk i-1). After computing, stage s sends the batch's hidden states to stage s+1 over its link
(`StageLatency.send_time_s(tokens)`); the stage is free to compute again while it sends. A link
carries one transfer at a time (`link_contention`) or any number at once (the flow-shop model).
The last stage's output is the batch's tokens. The scheduler runs in stage 0's process, between
its batches: it learns of the tokens when the last stage finishes, or, if stage 0 is computing
then, when stage 0 finishes that batch (as the runtime's stage 0 takes them,
`tessel.pipeline.token_receiver`); only then is the batch's slot free again.

A new micro-batch is formed when stage 0 is idle and fewer than `max_in_flight` micro-batches are
in the pipeline (default: one per stage); with `pinned`, each in-flight slot is a virtual engine
with its own requests (vLLM V0), else every batch draws from one pool (vLLM V1). All events at one
instant are handled before the scheduler runs, so requests that arrive together share a batch.

Compute time of a micro-batch on a stage: each prefill chunk costs `prefill_time_s(c, p)` (a
stage with `prefill_pass_time_s`, the cost model's, prices the chunks as one pass: what a pass pays
once is counted once); the
decode steps together cost `decode_time_s(B, sum of contexts)`; `mix="sum"` adds them (each priced
as its own pass over the weights: an upper bound), `mix="max"` takes the larger part (a roofline
reading: compute-bound prefill hides memory-bound decode when they share the weight reads).
`SimConfig.logits_time_s(n)`, when set, is added on the last stage to a batch holding the last
chunk of n prompts: the LM head that only a prompt's last token needs (cost-model stages leave it
out of `prefill_time_s`; their `decode_time_s` includes it). A stage with a `step_time_s(n)` (the
cost model's: the engine's scheduling and input work for a batch of n sequences, on the first
stage) adds it to every batch it computes. A stage whose weights partly live in
host memory streams them in for every batch: `SimConfig.offload_s[s]` is added to each batch's
time on stage s (or overlapped with it: max, under `offload_overlap`), as the planner counts it.
A stage with an emulated speed schedule (`SimConfig.slowdowns`) has its compute times multiplied by
the schedule's factor at the seconds since its first batch, as the runtime's stage sleeps by it.

CPU stages that share one host's cores (`SimConfig.cores`, a `CoreSharing`) share them as the OS
does, by processor sharing: a host whose cores run `slots` stages at full speed (cores / threads
per stage) gives each of its n computing stages the rate min(1, slots / n), re-rated whenever one
starts or ends; with `CoreSharing.contention` that rate is divided by 1 + c * (min(n, slots) - 1), c
the stage's decode or prefill slowdown per stage beside it (their weights and KV stream through one
memory: `tessel.profiling.contention`). A stage's batch holds the host's cores for its CPU work
only: a stage emulating speed s computes (s of its priced time, at the shared rate) and then sleeps
(1/s - 1) x the wall time that took, off the cores, as the runtime's emulation does
(`tessel.pipeline.stage`). The
stage times priced for sharing (the cost model's static `core_share`, every stage computing at
once) are divided by that factor first, so that sharing is counted once. Other work on the host
(`CoreSharing.background`: threads of other programs that want a core all along) takes its fair
share too: each of the n stages then runs at min(1, slots / (n + background)).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace

from tessel.chunk.latency import PipelineLatency, StageLatency
from tessel.sim.kv_pool import KvPool, KvPoolCounter, KvRestoreStats
from tessel.sim.requests import Request
from tessel.sim.scheduler import MicroBatch, SimScheduler, SimSchedulerConfig, SimSequence, Work

MIX_RULES = ("sum", "max")

# Events at one instant are handled in this order, then the scheduler runs.
_COMPUTE_DONE, _SEND_DONE, _ARRIVAL, _CPU_DONE = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class CoreSharing:
    """Stages that share a host's cores (module docstring). Per stage: `hosts` (None: a device of
    its own), `priced_share` (the static sharing factor its priced times include, divided out) and
    `cpu_fraction` (the share of its priced time spent computing: its emulated speed; the rest it
    sleeps); per host, `slots`: how many of its stages compute at full speed at once."""

    hosts: tuple[Hashable | None, ...]
    slots: dict[Hashable, float]
    priced_share: tuple[float, ...]
    cpu_fraction: tuple[float, ...]
    background: dict[Hashable, float] = field(default_factory=dict)  # per host: other runnable threads
    # per stage, (decode, prefill) slowdown per stage computing beside it on its host (memory
    # contention, `tessel.profiling.contention`); () or (0, 0): none
    contention: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        n = len(self.hosts)
        if len(self.priced_share) != n or len(self.cpu_fraction) != n:
            raise ValueError(f"core sharing: {n} hosts, {len(self.priced_share)} shares, "
                             f"{len(self.cpu_fraction)} CPU fractions")  # fmt: skip
        if any(h is not None and self.slots.get(h, 0) <= 0 for h in self.hosts):
            raise ValueError(f"core sharing: every host needs slots > 0, got {self.slots}")
        if any(not 0 < f <= 1 for f in self.cpu_fraction) or any(x <= 0 for x in self.priced_share):
            raise ValueError("core sharing: CPU fractions must be in (0, 1] and shares > 0")
        if any(b < 0 for b in self.background.values()):
            raise ValueError(f"core sharing: background threads must be >= 0, got {self.background}")
        if self.contention and (len(self.contention) != n or any(min(c) < 0 for c in self.contention)):
            raise ValueError(f"core sharing: {n} stages need (decode, prefill) contention >= 0 each")

    def slowdown(self, index: int, batch: MicroBatch, beside: int) -> float:
        """Stage `index`'s memory slowdown for `batch` with `beside` stages of its host computing at
        the same time (1: none)."""
        if not self.contention or beside <= 0:
            return 1.0
        decode, prefill = self.contention[index]
        slope = decode if all(item.kind == "decode" for item in batch.items) else prefill
        return 1.0 + slope * beside


@dataclass(slots=True)
class _CpuJob:
    """A batch's CPU work on a shared host: `remaining` seconds at full speed, at `rate` since `since_s`."""

    batch: MicroBatch
    start_s: float
    remaining: float
    sleep_per_wall: float  # seconds slept per wall second of CPU work (emulated speed)
    offload_s: float
    rate: float = 1.0
    since_s: float = 0.0
    version: int = 0


@dataclass(slots=True)
class SimConfig:
    scheduler: SimSchedulerConfig = field(default_factory=SimSchedulerConfig)
    max_in_flight: int | None = None  # micro-batches in the pipeline at once (None = number of stages)
    link_contention: bool = True
    mix: str = "sum"
    logits_time_s: Callable[[int], float] | None = None  # last stage: LM head of n finished prompts
    offload_s: tuple[float, ...] = ()  # per stage: streaming its host-offloaded bytes, every batch
    offload_overlap: bool = False  # batch time = max(compute, offload) instead of the sum
    pinned: bool = False  # one virtual engine per in-flight slot, requests pinned to one (vLLM V0)
    kv_pools: tuple[KvPool | None, ...] = ()  # per stage: its device-resident KV (tessel.sim.kv_pool)
    # per stage, (seconds since the stage's first batch, factor) changes: from then on its compute
    # times are multiplied by the factor (an emulated speed schedule; `slowdowns_for`)
    slowdowns: tuple[tuple[tuple[float, float], ...], ...] = ()
    cores: CoreSharing | None = None  # CPU stages sharing a host's cores (processor sharing)

    def __post_init__(self) -> None:
        if any(t < 0 for t in self.offload_s):
            raise ValueError(f"offload times must be >= 0, got {self.offload_s}")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.mix not in MIX_RULES:
            raise ValueError(f"mix rule {self.mix!r} not in {MIX_RULES}")


@dataclass(frozen=True, slots=True)
class Interval:
    """One box of the Gantt chart: stage `stage` computing ("compute") or sending ("send") a batch."""

    stage: int
    kind: str
    start_s: float
    end_s: float
    batch_id: int
    items: tuple[Work, ...]  # what the batch holds: prefill chunks and decode steps per request
    group: int = 0  # the batch's virtual engine (pinned mode)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request: Request
    first_token_s: float
    finish_s: float

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.request.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.request.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.request.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class SimResult:
    n_stages: int
    records: tuple[RequestRecord, ...]  # in request id order
    intervals: tuple[Interval, ...]  # in start order
    batches: int
    kv_restores: tuple[KvRestoreStats | None, ...] = ()  # per stage with a KV pool (tessel.sim.kv_pool)


class _Stage:
    __slots__ = ("arrived", "busy", "first_s", "next_id")

    def __init__(self) -> None:
        self.arrived: dict[int, MicroBatch] = {}
        self.busy = False
        self.next_id = 0  # the batch this stage must compute next
        self.first_s: float | None = None  # when it started its first batch


def slowdowns_for(speed: float, schedule) -> tuple[tuple[float, float], ...]:
    """A stage's (seconds, compute-time factor) changes from its emulated `speed` (which its priced
    times already include) and its speed `schedule` ([[seconds, speed], ...])."""
    return tuple((seconds, speed / changed) for seconds, changed in schedule or ())


def _slowdown(changes: tuple[tuple[float, float], ...], elapsed_s: float) -> float:
    factor = 1.0
    for seconds, changed in changes:
        if seconds > elapsed_s:
            break
        factor = changed
    return factor


class Simulator:
    def __init__(self, pipeline: PipelineLatency, config: SimConfig | None = None) -> None:
        self.pipeline = pipeline
        self.config = config or SimConfig()

    def run(self, requests: list[Request]) -> SimResult:
        return PipelineRun(self.pipeline, self.config, requests).run()


def simulate(
    pipeline: PipelineLatency, requests: list[Request], config: SimConfig | None = None
) -> SimResult:
    return Simulator(pipeline, config).run(requests)


def batch_compute_time_s(
    stage: StageLatency,
    batch: MicroBatch,
    mix: str = "sum",
    logits_time_s: Callable[[int], float] | None = None,
) -> float:
    chunks = [(item.tokens, item.offset) for item in batch.items if item.kind == "prefill"]
    pass_time_s = getattr(
        stage, "prefill_pass_time_s", None
    )  # cost-model stages: one pass, shared costs once
    if pass_time_s is not None:
        prefill = pass_time_s(chunks)
    else:
        prefill = sum(stage.prefill_time_s(c, p) for c, p in chunks)
    decodes = [item for item in batch.items if item.kind == "decode"]
    decode = stage.decode_time_s(len(decodes), sum(item.offset + 1 for item in decodes)) if decodes else 0.0
    time = prefill + decode if mix == "sum" else max(prefill, decode)
    step_time_s = getattr(stage, "step_time_s", None)  # the engine's per-step work (cost-model stages)
    if step_time_s is not None:
        time += step_time_s(len({item.request_id for item in batch.items}))
    if logits_time_s is not None:  # last stage: LM head for the prompts this batch finishes
        finished = sum(1 for item in batch.items if item.kind == "prefill" and item.samples)
        time += logits_time_s(finished) if finished else 0.0
    return time


class PipelineRun:
    """One pipeline serving its requests: the event loop (`run`) and what each event does; the
    simulator of devices shared by several pipelines (`tessel.sim.shared_devices`) runs several
    of these on one event heap."""

    def __init__(self, pipeline: PipelineLatency, config: SimConfig, requests: list[Request]) -> None:
        ids = [request.id for request in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        self.latency = pipeline.stages
        self.n_stages = pipeline.n_stages
        self.config = config
        self.max_in_flight = config.max_in_flight or self.n_stages
        if config.offload_s and len(config.offload_s) != self.n_stages:
            raise ValueError(f"{len(config.offload_s)} offload times for {self.n_stages} stages")
        if config.kv_pools and len(config.kv_pools) != self.n_stages:
            raise ValueError(f"{len(config.kv_pools)} KV pools for {self.n_stages} stages")
        self.kv_pools = [None if pool is None else KvPoolCounter(pool) for pool in config.kv_pools]
        if config.slowdowns and len(config.slowdowns) != self.n_stages:
            raise ValueError(f"{len(config.slowdowns)} speed schedules for {self.n_stages} stages")
        self.requests = requests
        if config.pinned:
            config = replace(config, scheduler=replace(config.scheduler, groups=self.max_in_flight))
            self.config = config
        self.scheduler = SimScheduler(config.scheduler)
        self.groups = config.scheduler.groups
        self.group_busy = [False] * self.groups  # pinned: a group has at most one batch in flight
        self.next_group = 0
        self.stages = [_Stage() for _ in range(self.n_stages)]
        self.unseen: list[MicroBatch] = []  # finished on the last stage while stage 0 computed
        self.link_busy = [False] * self.n_stages
        self.link_queue: list[deque[MicroBatch]] = [deque() for _ in range(self.n_stages)]
        self.in_flight = 0
        self.events: list[tuple[float, int, int, int, object]] = []
        self.counter = 0
        self.intervals: list[Interval] = []
        self.sequences: dict[int, SimSequence] = {}
        if config.cores is not None and len(config.cores.hosts) != self.n_stages:
            raise ValueError(f"core sharing of {len(config.cores.hosts)} stages for {self.n_stages} stages")
        self.cpu_jobs: dict[Hashable, dict[int, _CpuJob]] = {}  # per shared host: stage -> its CPU work

    def push(self, time_s: float, kind: int, stage: int, payload: object) -> None:
        heapq.heappush(self.events, (time_s, kind, self.counter, stage, payload))
        self.counter += 1

    def arrive(self) -> None:
        """Every request's arrival, as an event."""
        for request in self.requests:
            self.push(request.arrival_s, _ARRIVAL, 0, request)

    def run(self) -> SimResult:
        self.arrive()
        while self.events:
            now = self.events[0][0]
            while self.events and self.events[0][0] == now:
                _, kind, _, stage, payload = heapq.heappop(self.events)
                self.handle(now, kind, stage, payload)
            self.dispatch(now)
        return self.result()

    def handle(self, now: float, kind: int, stage: int, payload) -> None:
        if kind == _ARRIVAL:
            self.sequences[payload.id] = self.scheduler.add(payload)
        elif kind == _COMPUTE_DONE:
            self.compute_done(now, stage, payload)
        elif kind == _CPU_DONE:
            self.cpu_done(now, stage, payload)
        else:
            self.send_done(now, stage, payload)

    def result(self) -> SimResult:
        unfinished = [s.request.id for s in self.sequences.values() if s.finish_s is None]
        if unfinished or self.in_flight:
            raise RuntimeError(f"simulation ended with unfinished requests {unfinished[:10]}")
        records = tuple(
            RequestRecord(s.request, s.first_token_s, s.finish_s)  # type: ignore[arg-type]
            for s in sorted(self.sequences.values(), key=lambda s: s.request.id)
        )
        intervals = tuple(sorted(self.intervals, key=lambda i: (i.start_s, i.stage, i.kind)))
        restores = tuple(None if pool is None else pool.stats() for pool in self.kv_pools)
        return SimResult(self.n_stages, records, intervals, self.scheduler.batches_formed, restores)

    def dispatch(self, now: float) -> None:
        """Form new micro-batches while stage 0 is idle and the pipeline has room."""
        first = self.stages[0]
        while not first.busy and self.in_flight < self.max_in_flight:
            batch = self.next_batch()
            if batch is None:
                return
            self.in_flight += 1
            first.arrived[batch.id] = batch
            self.try_start(now, 0)

    def next_batch(self) -> MicroBatch | None:
        if self.groups == 1:
            return self.scheduler.schedule()
        for step in range(self.groups):  # round robin over the groups with no batch in flight
            group = (self.next_group + step) % self.groups
            if self.group_busy[group]:
                continue
            batch = self.scheduler.schedule(group)
            if batch is not None:
                self.group_busy[group] = True
                self.next_group = (group + 1) % self.groups
                return batch
        return None

    def try_start(self, now: float, index: int) -> None:
        stage = self.stages[index]
        if stage.busy or stage.next_id not in stage.arrived or not self.acquire(index):
            return
        batch = stage.arrived.pop(stage.next_id)
        stage.next_id += 1
        stage.busy = True
        config = self.config
        logits = config.logits_time_s if index == self.n_stages - 1 else None
        time = batch_compute_time_s(self.latency[index], batch, config.mix, logits)
        if stage.first_s is None:
            stage.first_s = now
        factor = _slowdown(config.slowdowns[index], now - stage.first_s) if config.slowdowns else 1.0
        time *= factor
        offload = config.offload_s[index] if config.offload_s else 0.0
        if self.kv_pools and self.kv_pools[index] is not None:  # evicted KV comes back first
            running = (s.scheduled_prompt + s.generated for s in self.scheduler.running)
            offload += self.kv_pools[index].restore_s(running, sum(item.offset for item in batch.items))
        cores = config.cores
        if cores is not None and cores.hosts[index] is not None:
            self.start_cpu(now, index, batch, time, factor, offload)
            return
        end = now + (max(time, offload) if config.offload_overlap else time + offload)
        self.record(index, "compute", now, end, batch)
        self.push(end, _COMPUTE_DONE, index, batch)

    # ---- CPU stages sharing a host's cores (processor sharing) --------------------------------

    def start_cpu(
        self, now: float, index: int, batch: MicroBatch, time: float, factor: float, offload: float
    ) -> None:
        """Stage `index` starts `batch` on its host's shared cores: `time` is its priced time (with
        the static share and the speed schedule's `factor` in it)."""
        cores = self.config.cores
        base = time / cores.priced_share[index] / factor  # on a core of its own, at its plan speed
        fraction = cores.cpu_fraction[index]
        job = _CpuJob(batch, now, base * fraction, factor / fraction - 1.0, offload)
        host = cores.hosts[index]
        self.advance(now, host)
        self.cpu_jobs.setdefault(host, {})[index] = job
        self.rerate(now, host)

    def advance(self, now: float, host: Hashable) -> None:
        for job in self.cpu_jobs.get(host, {}).values():
            job.remaining = max(job.remaining - (now - job.since_s) * job.rate, 0.0)
            job.since_s = now

    def rerate(self, now: float, host: Hashable) -> None:
        """Each computing stage of `host` at rate min(1, slots / (n + background)); their ends
        rescheduled."""
        cores = self.config.cores
        jobs = self.cpu_jobs.get(host, {})
        rate = min(1.0, cores.slots[host] / (len(jobs) + cores.background.get(host, 0.0))) if jobs else 1.0
        beside = min(len(jobs), cores.slots[host]) - 1  # stages on the host's cores at once, less one
        for index, job in jobs.items():
            own = rate / cores.slowdown(index, job.batch, beside)
            job.rate, job.since_s, job.version = own, now, job.version + 1
            self.push(now + job.remaining / own, _CPU_DONE, index, (job, job.version))

    def cpu_done(self, now: float, index: int, payload: tuple[_CpuJob, int]) -> None:
        job, version = payload
        host = self.config.cores.hosts[index]
        jobs = self.cpu_jobs.get(host, {})
        if jobs.get(index) is not job or job.version != version:
            return  # re-rated since: a later event ends it
        self.advance(now, host)
        del jobs[index]
        self.rerate(now, host)
        time = (now - job.start_s) * (1.0 + job.sleep_per_wall)  # its CPU work, then the emulation's sleep
        offload = job.offload_s
        end = job.start_s + (max(time, offload) if self.config.offload_overlap else time + offload)
        self.record(index, "compute", job.start_s, end, job.batch)
        self.push(end, _COMPUTE_DONE, index, job.batch)

    def acquire(self, index: int) -> bool:
        """Whether stage `index`'s device is free for it now (always: a device per stage)."""
        return True

    def release(self, now: float, index: int) -> None:
        """Stage `index` finished computing: its device is free (nothing else waits for it)."""

    def compute_done(self, now: float, index: int, batch: MicroBatch) -> None:
        self.stages[index].busy = False
        self.release(now, index)
        if index == 0:  # stage 0 is between batches: the tokens that came back meanwhile are taken
            for done in self.unseen:
                self.tokens_back(now, done)
            self.unseen.clear()
        if index == self.n_stages - 1:
            if self.stages[0].busy:
                self.unseen.append(batch)
            else:
                self.tokens_back(now, batch)
        elif self.config.link_contention:
            self.link_queue[index].append(batch)
            self.try_send(now, index)
        else:
            self.send(now, index, batch)
        if index > 0:
            self.try_start(now, index)

    def tokens_back(self, now: float, batch: MicroBatch) -> None:
        """The scheduler takes `batch`'s tokens: its requests advance, its slot is free."""
        self.in_flight -= 1
        if self.groups > 1:
            self.group_busy[batch.group] = False
        self.scheduler.complete(batch, now)

    def try_send(self, now: float, index: int) -> None:
        if not self.link_busy[index] and self.link_queue[index]:
            self.link_busy[index] = True
            self.send(now, index, self.link_queue[index].popleft())

    def send(self, now: float, index: int, batch: MicroBatch) -> None:
        end = now + self.latency[index].send_time_s(batch.tokens)
        if end > now:
            self.record(index, "send", now, end, batch)
        self.push(end, _SEND_DONE, index, batch)

    def send_done(self, now: float, index: int, batch: MicroBatch) -> None:
        if self.config.link_contention:
            self.link_busy[index] = False
            self.try_send(now, index)
        self.stages[index + 1].arrived[batch.id] = batch
        self.try_start(now, index + 1)

    def record(self, stage: int, kind: str, start: float, end: float, batch: MicroBatch) -> None:
        self.intervals.append(Interval(stage, kind, start, end, batch.id, batch.items, batch.group))
