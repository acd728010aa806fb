"""Stage 0's engine on a plan's executor in one process (a one-stage plan): several in-flight slots,
CPP chunks, aborts, preemption and async scheduling must give exactly the single-process engine's
tokens (the oracle: `LLM`)."""

from __future__ import annotations

import threading
import time

import pytest

from loopback_stage import pipeline_llm, two_stages
from pipeline_plans import write_plan
from tessel import LLM, SamplingParams
from tessel.chunk.latency import PipelineLatency
from tessel.engine.engine_config import EngineConfig
from tessel.errors import TesselError
from tessel.pipeline.chunk_cutter import ChunkCutter
from tessel.pipeline.comm.messages import PeerLostError
from tessel.pipeline.executor import ProcessExecutor
from tessel.pipeline.options import RunOptions
from tessel.pipeline.run_plan import load_run_plan
from tessel.sim.linear import LinearStage

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Once upon a time",
    "Paged attention stores keys and values in blocks; a block table maps positions to blocks. " * 3,
    "One two three four five six",
]


def reference(model_dir, prompts, params, **kwargs):
    llm = LLM(model_dir, **kwargs)
    return [out.token_ids for out in llm.generate(prompts, params, use_progress=False)]


def pipeline(model_dir, tmp_path, *, slots, cutter_min=None, **kwargs):
    plan_path = write_plan(tmp_path / "plan1.json", model_dir, [(0, 5)])
    cutter = None
    if cutter_min is not None:  # two stages whose time is all per token: the planner cuts finely
        stage = LinearStage(prefill_base_s=1e-4, prefill_per_token_s=1e-4)
        cutter = ChunkCutter(PipelineLatency((stage, stage)), min_tokens=cutter_min, grid_tokens=16)
    return pipeline_llm(model_dir, plan_path, slots=slots, cutter=cutter, **kwargs)


@pytest.mark.parametrize(("slots", "cutter_min"), [(1, None), (3, None), (2, 16)])
def test_greedy_equals_engine(tiny_dirs, tmp_path, slots, cutter_min):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = pipeline(tiny_dirs["tied"], tmp_path, slots=slots, cutter_min=cutter_min)
    got = [out.token_ids for out in engine.generate(PROMPTS, params, use_progress=False)]
    assert got == reference(tiny_dirs["tied"], PROMPTS, params)
    if cutter_min is not None:
        assert engine.executor.stage.stats.cpp_prompts >= 2
        assert engine.executor.stage.stats.cpp_chunks > engine.executor.stage.stats.cpp_prompts


def test_seeded_sampling_equals_engine(tiny_dirs, tmp_path):
    params = [
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7 + i, max_tokens=10) for i in range(3)
    ]
    engine = pipeline(tiny_dirs["tied"], tmp_path, slots=2)
    got = [out.token_ids for out in engine.generate(PROMPTS[:3], params, use_progress=False)]
    assert got == reference(tiny_dirs["tied"], PROMPTS[:3], params)


def test_small_pool_preempts_and_still_matches(tiny_dirs, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kwargs = {"num_kv_blocks": 16, "block_size": 4, "max_model_len": 64}
    engine = pipeline(tiny_dirs["tied"], tmp_path, slots=2, **kwargs)
    prompts = [p[:60] for p in PROMPTS]
    got = [out.token_ids for out in engine.generate(prompts, params, use_progress=False)]
    assert engine.scheduler.num_preemptions > 0
    assert got == reference(tiny_dirs["tied"], prompts, params, **kwargs)
    assert engine.num_free_blocks == engine.num_total_blocks


def test_abort_frees_blocks(tiny_dirs, tmp_path):
    engine = pipeline(tiny_dirs["tied"], tmp_path, slots=2, cutter_min=16)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.step()
    engine.abort_request("r1")
    engine.abort_request("r3")
    reasons = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert reasons == {"r0": "length", "r1": "abort", "r2": "length", "r3": "abort", "r4": "length"}
    assert engine.num_free_blocks == engine.num_total_blocks


def test_emulated_speed_sleeps_in_proportion(tiny_dirs, tmp_path):
    """A stage at speed 0.25 sleeps 3x its measured compute after every micro-batch (emulation)."""
    plan_path = write_plan(tmp_path / "slow.json", tiny_dirs["tied"], [(0, 5)], speeds=[0.25])
    engine = pipeline_llm(tiny_dirs["tied"], plan_path, slots=1)
    engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4), use_progress=False)
    stats = engine.executor.stage.stats
    assert stats.batches > 0
    assert stats.emulation_sleep_s == pytest.approx(3.0 * stats.compute_s, rel=1e-9)


def test_every_idle_slot_is_launched_in_one_step(tiny_dirs, tmp_path):
    """Each step launches every idle slot before it waits for the oldest micro-batch, so with two
    slots two micro-batches are in flight (a pipeline of two stages keeps both busy)."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = pipeline(tiny_dirs["tied"], tmp_path, slots=2)
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, params)
    in_flight = []
    original = engine._complete

    def complete(record):
        in_flight.append(len(engine._in_flight) + 1)  # the one being completed was popped
        return original(record)

    engine._complete = complete
    while engine.has_unfinished_requests():
        engine.step()
    assert max(in_flight) == 2 and in_flight.count(2) >= len(in_flight) // 2


def test_a_one_stage_plan_runs_one_micro_batch(tiny_dirs, tmp_path):
    """One stage has nothing to overlap with: the plan's m does not split its rows."""
    plan_path = write_plan(tmp_path / "plan1.json", tiny_dirs["tied"], [(0, 5)], micro_batches=4)
    assert load_run_plan(plan_path).micro_batches == 1


@pytest.mark.parametrize("arrived", [False, True])
def test_tokens_back_before_a_launch_are_taken_first(tiny_dirs, tmp_path, monkeypatch, arrived):
    """Two stages in this process: tokens that came back while stage 0 computed are completed before
    its next launch (a request's first token out, its slot free); tokens not yet back are waited for
    after the launches. Either way the tokens are the engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine, _ = two_stages(tiny_dirs["tied"], tmp_path, monkeypatch, slots=2, arrived=arrived)
    in_flight = []
    original = engine._complete

    def complete(record):
        in_flight.append(len(engine._in_flight) + 1)
        return original(record)

    engine._complete = complete
    got = [out.token_ids for out in engine.generate(PROMPTS[:4], params, use_progress=False)]
    assert got == reference(tiny_dirs["tied"], PROMPTS[:4], params)
    # back at once: each micro-batch is completed before the next launch, never two in flight
    assert max(in_flight) == (1 if arrived else 2)


# ---- async scheduling on a plan: stage 0 computes its decode micro-batches on a worker thread while
# the engine schedules the next slot's (`ProcessExecutor`, `async_scheduling=True`)


@pytest.mark.parametrize("slots", [1, 2])
def test_two_stages_overlapped_give_the_engines_tokens(tiny_dirs, tmp_path, monkeypatch, slots):
    """Greedy and seeded requests, prompts of several lengths (prefills run on the engine's thread,
    in launch order after the worker's queue): the engine's tokens, the decode micro-batches computed
    by stage 0 on the worker, never on the engine's thread."""
    engine, _ = two_stages(
        tiny_dirs["tied"], tmp_path, monkeypatch, slots=slots, async_scheduling=True, max_num_seqs=2
    )  # requests wait, so prefills come between decode micro-batches
    threads = set()
    run = engine.executor._run_stage0

    def run_stage0(micro, message, input_ids):
        on_main = threading.current_thread() is threading.main_thread()
        threads.add((bool(micro.batch.prefills), on_main))
        if not on_main:
            time.sleep(0.005)  # a slow stage 0: a micro-batch launched later must still leave after
        return run(micro, message, input_ids)

    sent = []
    send = engine.executor.comm.send_batch

    def send_batch(message, hidden, input_ids=None):
        sent.append(message.batch_id)
        return send(message, hidden, input_ids)

    monkeypatch.setattr(engine.executor, "_run_stage0", run_stage0)
    monkeypatch.setattr(engine.executor.comm, "send_batch", send_batch)
    params = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.8, top_k=20, seed=11 + i, max_tokens=7) for i in range(2)
    ]
    got = [out.token_ids for out in engine.generate(PROMPTS, params, use_progress=False)]
    assert got == reference(tiny_dirs["tied"], PROMPTS, params)
    assert engine.executor.num_overlapped > 0
    assert threads == {(True, True), (False, False)}
    assert sent == sorted(sent)  # in launch order


def test_a_one_stage_plan_overlapped_samples_on_the_worker(tiny_dirs, tmp_path):
    """Stage 0 alone samples: the micro-batch's result is set by the worker and collected."""
    plan_path = write_plan(tmp_path / "plan1.json", tiny_dirs["tied"], [(0, 5)])
    engine = pipeline_llm(tiny_dirs["tied"], plan_path, slots=1, async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [out.token_ids for out in engine.generate(PROMPTS[:3], params, use_progress=False)]
    assert got == reference(tiny_dirs["tied"], PROMPTS[:3], params)
    assert engine.executor.num_overlapped > 0


def test_a_lost_stage_on_the_worker_stops_the_engine(tiny_dirs, tmp_path, monkeypatch):
    """A send that fails on the worker is raised by the step that collects it, and kept as the
    executor's failure: the next step raises it too, nothing waits."""
    engine, _ = two_stages(tiny_dirs["tied"], tmp_path, monkeypatch, slots=2, async_scheduling=True)
    comm = engine.executor.comm
    send = comm.send_batch

    def send_batch(message, hidden, input_ids=None):
        if not message.meta.prefills and threading.current_thread() is not threading.main_thread():
            raise PeerLostError("stage 1: link cut (test)")
        return send(message, hidden, input_ids)

    monkeypatch.setattr(comm, "send_batch", send_batch)
    engine.add_request("r0", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    with pytest.raises(PeerLostError, match="link cut"):
        for _ in range(10):
            engine.step()
    assert isinstance(engine.executor.failure, PeerLostError)
    with pytest.raises(PeerLostError, match="link cut"):
        engine.step()


def test_a_tensor_parallel_stage_0_is_refused(tiny_dirs, tmp_path):
    plan_path = write_plan(tmp_path / "tp.json", tiny_dirs["tied"], [(0, 5)], degrees=[2])
    executor = ProcessExecutor(RunOptions(plan_path, tiny_dirs["tied"]))
    with pytest.raises(TesselError, match="tensor-parallel"):
        executor.configure(EngineConfig(async_scheduling=True))
    assert not executor.overlaps


def test_a_worker_stuck_on_a_dead_link_does_not_hold_the_engine(tiny_dirs, tmp_path, monkeypatch):
    """Stage 0's worker blocked in a send that never returns: once the stage's watcher aborts the
    executor, the step waiting for that micro-batch raises the loss instead of waiting."""
    engine, _ = two_stages(tiny_dirs["tied"], tmp_path, monkeypatch, slots=1, async_scheduling=True)
    comm, release = engine.executor.comm, threading.Event()
    send = comm.send_batch

    def send_batch(message, hidden, input_ids=None):
        if threading.current_thread() is not threading.main_thread():
            release.wait(30)  # a link that does not answer
        return send(message, hidden, input_ids)

    monkeypatch.setattr(comm, "send_batch", send_batch)
    watcher = threading.Timer(0.3, engine.executor.abort, [PeerLostError("stage 1 lost (test)")])
    engine.add_request("r0", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    watcher.start()
    started = time.monotonic()
    try:
        with pytest.raises(PeerLostError, match="stage 1 lost"):
            for _ in range(10):
                engine.step()
        assert time.monotonic() - started < 10
    finally:
        release.set()
        watcher.cancel()
