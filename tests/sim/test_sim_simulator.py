"""The discrete-event simulator against closed forms and the flow-shop recurrence."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest

from tessel.chunk.latency import PipelineLatency
from tessel.errors import TesselError
from tessel.sim.linear import LinearStage
from tessel.sim.requests import LengthDistribution, Request, poisson_requests
from tessel.sim.scheduler import MicroBatch, SimSchedulerConfig
from tessel.sim.sim_metrics import compute_metrics
from tessel.sim.simulator import SimConfig, batch_compute_time_s, simulate


def _random_stage(rng: np.random.Generator, last: bool = False) -> LinearStage:
    return LinearStage(
        prefill_base_s=float(rng.uniform(1e-4, 2e-3)),
        prefill_per_token_s=float(rng.uniform(1e-6, 5e-5)),
        attention_s=float(rng.uniform(0, 1e-9)),
        decode_base_s=float(rng.uniform(1e-4, 3e-3)),
        decode_per_seq_s=float(rng.uniform(0, 1e-5)),
        decode_per_context_s=float(rng.uniform(0, 1e-8)),
        send_latency_s=0.0 if last else float(rng.uniform(0, 2e-4)),
        send_per_token_s=0.0 if last else float(rng.uniform(0, 1e-7)),
    )


def _random_pipeline(rng: np.random.Generator, n_stages: int) -> PipelineLatency:
    return PipelineLatency(tuple(_random_stage(rng, s == n_stages - 1) for s in range(n_stages)))


def _flow_shop_makespan(pipeline: PipelineLatency, chunks: list[int]) -> float:
    """C(i,s) = max(C(i-1,s), C(i,s-1) + send(i,s-1)) + t_s(c_i, p_i), written out here as the oracle."""
    n_stages = pipeline.n_stages
    previous = [0.0] * n_stages  # C(i-1, s)
    offset = 0
    for size in chunks:
        current = []
        for s, stage in enumerate(pipeline.stages):
            ready = 0.0 if s == 0 else current[s - 1] + pipeline.stages[s - 1].send_time_s(size)
            current.append(max(previous[s], ready) + stage.prefill_time_s(size, offset))
        previous, offset = current, offset + size
    return previous[n_stages - 1]


def _random_chunks(rng: np.random.Generator, prompt: int, m: int) -> list[int]:
    cuts = np.sort(rng.choice(np.arange(1, prompt), size=m - 1, replace=False))
    return [int(c) for c in np.diff(np.concatenate([[0], cuts, [prompt]]))]


def _one_request_cpp(chunks: list[int], link_contention: bool) -> SimConfig:
    return SimConfig(
        SimSchedulerConfig(
            max_num_batched_tokens=1 << 30, chunk_sizes=lambda r: chunks, pipelined_prefill=True
        ),
        max_in_flight=len(chunks),
        link_contention=link_contention,
    )


@pytest.mark.parametrize("trial", range(8))
def test_one_request_matches_flow_shop_recurrence(trial: int) -> None:
    rng = np.random.default_rng()
    n_stages, m = int(rng.integers(1, 7)), int(rng.integers(1, 12))
    prompt = int(rng.integers(m + 1, 8000))
    pipeline, chunks = _random_pipeline(rng, n_stages), _random_chunks(rng, prompt, m)
    arrival = float(rng.uniform(0, 5))
    result = simulate(pipeline, [Request(0, arrival, prompt, 1)], _one_request_cpp(chunks, False))
    expected = _flow_shop_makespan(pipeline, chunks)
    assert result.records[0].ttft_s == pytest.approx(expected, rel=1e-12)
    assert result.records[0].finish_s == result.records[0].first_token_s


def test_flow_shop_holds_with_link_contention_when_sends_are_short() -> None:
    rng = np.random.default_rng()
    for _ in range(5):
        stages = [_random_stage(rng) for _ in range(4)]
        # sends shorter than any chunk's compute: the links never queue
        stages = [
            LinearStage(
                **{
                    **{k: getattr(s, k) for k in s.__dataclass_fields__},
                    "send_per_token_s": 0.0,
                    "send_latency_s": s.prefill_base_s / 2,
                }
            )
            for s in stages
        ]
        pipeline = PipelineLatency(tuple(stages))
        chunks = _random_chunks(rng, 4096, 7)
        result = simulate(pipeline, [Request(0, 0.0, 4096, 1)], _one_request_cpp(chunks, True))
        assert result.records[0].ttft_s == pytest.approx(_flow_shop_makespan(pipeline, chunks), rel=1e-12)


@pytest.mark.parametrize("trial", range(4))
def test_one_request_matches_tessel_chunk_makespan(trial: int) -> None:
    schedule = pytest.importorskip("tessel.chunk.schedule", reason="tessel.chunk flow-shop not built yet")
    rng = np.random.default_rng()
    n_stages, m = int(rng.integers(1, 7)), int(rng.integers(1, 12))
    prompt = int(rng.integers(m + 1, 8000))
    pipeline, chunks = _random_pipeline(rng, n_stages), _random_chunks(rng, prompt, m)
    result = simulate(pipeline, [Request(0, 0.0, prompt, 1)], _one_request_cpp(chunks, False))
    expected = schedule.evaluate_chunks(pipeline, chunks).makespan_s
    assert result.records[0].ttft_s == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("n_stages", "m"), [(1, 1), (2, 3), (4, 4), (4, 9), (7, 2), (5, 16), (None, None)])
def test_equal_chunks_on_equal_stages_give_the_textbook_bubble(n_stages: int | None, m: int | None) -> None:
    rng = np.random.default_rng()
    if n_stages is None:
        n_stages, m = int(rng.integers(1, 12)), int(rng.integers(1, 40))
    per_token_s = 2.0 ** -int(rng.integers(8, 20))  # binary fractions: the sums carry no rounding
    size = int(rng.integers(1, 256))
    pipeline = PipelineLatency((LinearStage(prefill_per_token_s=per_token_s),) * n_stages)
    result = simulate(pipeline, [Request(0, 0.0, size * m, 1)], _one_request_cpp([size] * m, True))
    metrics = compute_metrics(result)
    assert metrics.bubble_fraction == (n_stages - 1) / (m + n_stages - 1)
    assert metrics.span_s == (m + n_stages - 1) * size * per_token_s
    # the default in-flight limit (one per stage) is no slower here: chunk i enters as chunk i-S leaves
    default = simulate(
        pipeline,
        [Request(0, 0.0, size * m, 1)],
        SimConfig(SimSchedulerConfig(max_num_batched_tokens=size, pipelined_prefill=True)),
    )
    assert compute_metrics(default).bubble_fraction == metrics.bubble_fraction


def test_single_stage_single_request_closed_form() -> None:
    rng = np.random.default_rng()
    stage = _random_stage(rng, last=True)
    prompt, output = int(rng.integers(1, 3000)), int(rng.integers(2, 60))
    config = SimConfig(SimSchedulerConfig(max_num_batched_tokens=1 << 20, enable_chunked_prefill=False))
    record = simulate(PipelineLatency((stage,)), [Request(0, 1.5, prompt, output)], config).records[0]
    assert record.ttft_s == pytest.approx(stage.prefill_time_s(prompt, 0), rel=1e-12)
    decode = sum(stage.decode_time_s(1, prompt + k) for k in range(1, output))
    assert record.finish_s - record.first_token_s == pytest.approx(decode, rel=1e-12)
    assert record.tpot_s == pytest.approx(decode / (output - 1), rel=1e-12)


def _workload(rng: np.random.Generator, n: int, rate: float, seed: int) -> list[Request]:
    prompt = LengthDistribution("lognormal", mean=float(rng.uniform(100, 1500)), sigma=0.7, high=8000)
    output = LengthDistribution("uniform", low=1, high=int(rng.integers(2, 80)))
    return poisson_requests(n, rate, prompt, output, seed=seed)


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("pipelined", [False, True])
def test_every_request_finishes_and_every_token_is_counted(pipelined: bool, pinned: bool) -> None:
    rng = np.random.default_rng()
    n_stages = int(rng.integers(1, 6))
    pipeline = _random_pipeline(rng, n_stages)
    requests = _workload(rng, 150, float(rng.uniform(5, 200)), int(rng.integers(1 << 30)))
    config = SimConfig(
        SimSchedulerConfig(
            max_num_seqs=int(rng.integers(1, 64)),
            max_num_batched_tokens=int(rng.integers(64, 2048)),
            pipelined_prefill=pipelined,
            kv_capacity_tokens=20_000,
        ),
        max_in_flight=int(rng.integers(1, 2 * n_stages + 1)),
        pinned=pinned,
    )
    result = simulate(pipeline, requests, config)
    assert [r.request for r in result.records] == sorted(requests, key=lambda r: r.id)
    by_id = {r.id: r for r in requests}
    for stage in range(n_stages):
        prefill, decode = defaultdict(int), defaultdict(int)
        for interval in result.intervals:
            if interval.stage == stage and interval.kind == "compute":
                for item in interval.items:
                    bucket = prefill if item.kind == "prefill" else decode
                    bucket[item.request_id] += item.tokens
        for request in requests:
            # every prompt token through every stage once; output - 1 decode steps (the first from prefill)
            assert prefill[request.id] == request.prompt_tokens
            assert decode[request.id] == request.output_tokens - 1
    for request in requests:
        # KV offsets: prefill chunks tile the prompt, decode step k attends to prompt + k tokens
        items = [
            w
            for i in result.intervals
            if i.stage == 0 and i.kind == "compute"
            for w in i.items
            if w.request_id == request.id
        ]
        chunks = [w for w in items if w.kind == "prefill"]
        assert [w.offset for w in chunks] == list(np.cumsum([0] + [w.tokens for w in chunks])[:-1])
        steps = [w.offset for w in items if w.kind == "decode"]
        assert steps == list(range(request.prompt_tokens, request.prompt_tokens + request.output_tokens - 1))
    for record in result.records:
        assert record.request.arrival_s <= record.first_token_s <= record.finish_s
    metrics = compute_metrics(result)
    assert metrics.output_tokens == sum(r.output_tokens for r in by_id.values())
    assert metrics.requests == len(requests)
    assert 0.0 <= metrics.bubble_fraction < 1.0
    assert all(0.0 < u <= 1.0 + 1e-12 for u in metrics.stage_utilisation)


def test_decode_step_waits_for_the_previous_token() -> None:
    rng = np.random.default_rng()
    n_stages = 4
    pipeline = _random_pipeline(rng, n_stages)
    request = Request(0, 0.0, 200, 30)
    result = simulate(pipeline, [request], SimConfig(SimSchedulerConfig(max_num_batched_tokens=64)))
    batches = defaultdict(list)
    for interval in result.intervals:
        if interval.kind == "compute":
            batches[interval.batch_id].append(interval)
    ordered = [sorted(batches[b], key=lambda i: i.stage) for b in sorted(batches)]
    for previous, current in zip(ordered, ordered[1:], strict=False):
        # one sequence, not pipelined: the next batch starts only after the previous left the last stage
        assert current[0].start_s >= previous[-1].end_s
    assert len(ordered) == 4 + 29  # ceil(200/64) prefill chunks + 29 decode steps


def test_higher_load_does_not_lower_p99_ttft() -> None:
    rng = np.random.default_rng()
    pipeline = _random_pipeline(rng, 4)
    seed = int(rng.integers(1 << 30))
    p99 = []
    for rate in (1.0, 10.0, 100.0, 1000.0):
        requests = poisson_requests(
            200, rate, LengthDistribution("fixed", 512), LengthDistribution("fixed", 16), seed=seed
        )
        metrics = compute_metrics(
            simulate(pipeline, requests, SimConfig(SimSchedulerConfig(max_num_seqs=32)))
        )
        p99.append(metrics.ttft_s.p99)
    assert p99 == sorted(p99)
    assert p99[-1] > p99[0]


def test_in_flight_limit_and_kv_capacity_are_respected() -> None:
    rng = np.random.default_rng()
    pipeline = _random_pipeline(rng, 3)
    requests = _workload(rng, 60, 500.0, 3)
    capacity = max(r.prompt_tokens + r.output_tokens for r in requests) + 100
    config = SimConfig(SimSchedulerConfig(kv_capacity_tokens=capacity), max_in_flight=2)
    result = simulate(pipeline, requests, config)
    events = []
    for interval in result.intervals:
        if interval.kind == "compute" and interval.stage == 0:
            events.append((interval.start_s, 1, interval.batch_id))
        if interval.kind == "compute" and interval.stage == 2:
            events.append((interval.end_s, -1, interval.batch_id))
    live = 0
    for _, step, _ in sorted(events):
        live += step
        assert live <= 2
    # KV: requests alive at once (admitted, not finished) never hold more than the capacity
    admitted: dict[int, float] = {}
    for interval in result.intervals:  # in start order
        for item in interval.items:
            admitted.setdefault(item.request_id, interval.start_s)
    for record in result.records:
        start = admitted[record.request.id]
        alive = [r for r in result.records if admitted[r.request.id] <= start < r.finish_s]
        assert sum(r.request.prompt_tokens + r.request.output_tokens for r in alive) <= capacity


def test_request_larger_than_kv_capacity_is_a_user_error() -> None:
    pipeline = PipelineLatency((LinearStage(prefill_base_s=1.0, decode_base_s=1.0),))
    config = SimConfig(SimSchedulerConfig(kv_capacity_tokens=100))
    with pytest.raises(TesselError, match="KV tokens"):
        simulate(pipeline, [Request(0, 0.0, 90, 20)], config)


def test_max_mix_rule_is_not_slower_than_sum() -> None:
    """Batch by batch (the same micro-batches): max(prefill, decode) never exceeds their sum. Whole
    runs are not comparable: faster batches change which requests meet in the next ones."""
    rng = np.random.default_rng()
    pipeline = _random_pipeline(rng, 2)
    requests = _workload(rng, 80, 50.0, 11)
    result = simulate(pipeline, requests, SimConfig(mix="sum"))
    batches = {i.batch_id: MicroBatch(i.batch_id, i.items) for i in result.intervals if i.kind == "compute"}
    assert any({w.kind for w in batch.items} == {"prefill", "decode"} for batch in batches.values())
    for batch in batches.values():
        for stage in pipeline.stages:
            mixed = batch_compute_time_s(stage, batch, "max")
            assert mixed <= batch_compute_time_s(stage, batch, "sum") * (1 + 1e-12)


def test_cpp_chunking_from_tessel_chunk_gives_its_predicted_ttft() -> None:
    from tessel.sim.cpp import cpp_chunk_sizer

    rng = np.random.default_rng()
    pipeline = _random_pipeline(rng, int(rng.integers(2, 6)))
    prompt = int(rng.integers(500, 6000))
    sizer = cpp_chunk_sizer(pipeline, grid_tokens=64)
    request = Request(0, 0.0, prompt, 1)
    chunks = sizer(request)
    assert sum(chunks) == prompt
    config = SimConfig(
        SimSchedulerConfig(max_num_batched_tokens=1 << 20, chunk_sizes=sizer, pipelined_prefill=True),
        max_in_flight=len(chunks),
        link_contention=False,
    )
    from tessel.chunk.schedule import evaluate_chunks

    record = simulate(pipeline, [request], config).records[0]
    assert record.ttft_s == pytest.approx(evaluate_chunks(pipeline, chunks).ttft_s, rel=1e-12)


def test_pinned_requests_stay_in_their_virtual_engine() -> None:
    rng = np.random.default_rng()
    n_stages = int(rng.integers(2, 6))
    pipeline = _random_pipeline(rng, n_stages)
    requests = _workload(rng, 120, float(rng.uniform(50, 500)), int(rng.integers(1 << 30)))
    result = simulate(
        pipeline, requests, SimConfig(SimSchedulerConfig(max_num_batched_tokens=512), pinned=True)
    )
    computes = [i for i in result.intervals if i.kind == "compute"]
    group_of: dict[int, int] = {}
    for interval in computes:
        for item in interval.items:
            assert group_of.setdefault(item.request_id, interval.group) == interval.group
    assert set(group_of.values()) == set(range(n_stages))  # 120 requests spread over all engines
    # one batch per engine in flight: an engine's batches do not overlap, entry to exit
    first = {i.batch_id: i for i in computes if i.stage == 0}
    exit_s = {i.batch_id: i.end_s for i in computes if i.stage == n_stages - 1}
    for group in range(n_stages):
        spans = sorted((first[b].start_s, exit_s[b]) for b in first if first[b].group == group)
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert start >= end
    # arrivals go to the engine with the fewest unfinished requests: sizes differ by at most one
    # among requests that arrive while none has finished
    first_finish = min(r.finish_s for r in result.records)
    early = [r.request.id for r in result.records if r.request.arrival_s < first_finish]
    counts = np.bincount([group_of[r] for r in early], minlength=n_stages)
    assert counts.max() - counts.min() <= 1


@pytest.mark.parametrize("trial", range(5))
def test_tokens_reach_the_scheduler_when_stage_0_is_between_batches(trial: int) -> None:
    """The scheduler runs in stage 0's process: a batch's tokens count when the last stage finishes
    it, or, if stage 0 computes then, when stage 0 finishes that batch (the runtime's rule)."""
    rng = np.random.default_rng(trial)
    n_stages = int(rng.integers(2, 5))
    stages = _random_pipeline(rng, n_stages).stages
    slowest = max(stage.prefill_per_token_s for stage in stages)  # stage 0 the slowest: it is busy
    pipeline = PipelineLatency((replace(stages[0], prefill_per_token_s=2 * slowest), *stages[1:]))
    requests = [Request(i, 0.0, int(rng.integers(64, 600)), 4) for i in range(2 * n_stages)]
    config = SimConfig(SimSchedulerConfig(max_num_batched_tokens=4096), pinned=True)
    result = simulate(pipeline, requests, config)
    computes = [i for i in result.intervals if i.kind == "compute"]
    stage0 = [i for i in computes if i.stage == 0]
    seen = 0
    for record in result.records:
        rid = record.request.id
        first = min(  # the last stage's end of the batch that held the prompt's last chunk
            i.end_s
            for i in computes
            if i.stage == n_stages - 1
            and any(w.request_id == rid and w.kind == "prefill" and w.samples for w in i.items)
        )
        busy = [i for i in stage0 if i.start_s < first < i.end_s]
        want = busy[0].end_s if busy else first
        seen += bool(busy)
        assert record.first_token_s == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert seen > 0  # some tokens came back while stage 0 computed
