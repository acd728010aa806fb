"""Serving through change (`tessel.pipeline.supervision.supervisor`): the planner's plan on the
surviving stages of a model the runtime loads (the rest of survivor planning: tests/plan/
test_survivors.py), requests moved between executors by recomputation, and one served pipeline that
loses a stage, is remapped live, and rolls back a remap whose new stage dies while loading.

Oracles: `make_plan` on the cluster of the devices left; one process's engine (`LLM`, never
disturbed) for the tokens of every moved request, greedy and seeded."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import pytest

from pipeline_plans import write_gpu_plan, write_plan
from stage_processes import release
from tessel.errors import TesselError
from tessel.plan.files.plan_file import load_plan
from tessel.plan.remap.survivors import survivor_plan

DEADLINE_S = 120.0  # generous: a loaded 2-core machine spawning stage processes


# ---- the plan on the survivors (the planning half: tests/plan/test_survivors.py) ----------------
def _cpu_cluster(path: Path, devices: int) -> Path:
    link = "{bandwidth_gbps: 80, latency_us: 50}"
    path.write_text(
        f"name: cpus\nnodes:\n  - name: localhost\n    gpus: {{type: cpu, count: {devices}}}\n"
        f"    intra_link: {link}\nnetwork: {link}\n"
    )
    return path


def test_survivor_plan_is_the_planners_when_the_cluster_is_at_hand(tiny_dirs, tmp_path):
    """The plan's cluster file is readable: the survivors' plan is the planner's on a cluster of the
    devices left (the oracle: `make_plan` on a cluster file that lists only those)."""
    from tessel.plan.api import PlanSettings, make_plan

    settings = PlanSettings(dtype="fp32", kv_dtype="fp32", time_limit_s=5)
    model = tiny_dirs["untied"]
    make_plan(model, _cpu_cluster(tmp_path / "c3.yaml", 3), "default", settings).plan_file().write(
        tmp_path / "p3.json"
    )
    plan = load_plan(tmp_path / "p3.json")
    survivor = survivor_plan(plan, {len(plan.stages) - 1})
    lost = plan.stages[-1].device
    assert lost not in {s.device for s in survivor.stages}
    direct = make_plan(model, _cpu_cluster(tmp_path / "c2.yaml", 2), "default", settings).plan_file()
    assert lost == "localhost/gpu2"  # so the two devices left are the 2-device cluster's
    assert [(s.device, s.layer_start, s.layer_end) for s in survivor.stages] == [
        (s.device, s.layer_start, s.layer_end) for s in direct.stages
    ]
    assert survivor.cluster.source == str(tmp_path / "c3.yaml")


# ---- moving requests between engines --------------------------------------------------------------
def _params():
    from tessel.engine.sampling_params import SamplingParams

    return [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=20, ignore_eos=True),
    ]


PROMPTS = ["Once upon a time", "The quick brown fox jumps"]


def test_requests_moved_to_another_executor_finish_as_undisturbed(tiny_dirs):
    """Half-way through, the requests move from the engine's executor to a fresh one (recomputed
    there): the same tokens as an undisturbed run, logprobs included, and `max_tokens` counts from
    the start."""
    from tessel.engine.executor import LocalExecutor
    from tessel.engine.llm_engine import LLM

    model = tiny_dirs["untied"]
    expected = LLM(model, max_num_seqs=4).generate(PROMPTS, _params(), use_progress=False)
    engine = LLM(model, max_num_seqs=4)
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params(), strict=True)):
        engine.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list] = {"r0": [], "r1": []}
    for _ in range(6):
        for out in engine.step():
            outputs[out.request_id].append(out)
    fresh = LocalExecutor()
    assert engine.replace_executor(fresh, fresh.start(engine.setup_for(fresh))) == ["r0", "r1"]
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    for rid, want in zip(["r0", "r1"], expected, strict=True):
        got = outputs[rid]
        assert [t for out in got for t in out.new_token_ids] == want.token_ids
        assert got[-1].finish_reason == "length" and got[-1].num_output_tokens == len(want.token_ids)
    assert [lp.token_id for lp in outputs["r0"][-1].logprobs] == expected[0].token_ids
    for got, want in zip(outputs["r0"][-1].logprobs, expected[0].logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


def test_a_swapped_out_request_moves_too(tiny_dirs):
    """A request preempted by swap (its KV in the old executor's host pool) moves like the others: the
    old pool's blocks are given back and the new executor recomputes it; tokens as undisturbed."""
    from tessel.engine.executor import LocalExecutor
    from tessel.engine.llm_engine import LLM
    from tessel.engine.sampling_params import SamplingParams

    model = tiny_dirs["tied"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [*PROMPTS, "hello world again", "a b c d e f"]
    expected = [o.token_ids for o in LLM(model, max_num_seqs=4).generate(prompts, params, use_progress=False)]
    small = dict(num_kv_blocks=20, block_size=4, max_model_len=64, preemption_mode="swap")
    small["host_kv_cache_gib"] = 0.001
    engine = LLM(model, max_num_seqs=4, **small)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while not any(seq.host_blocks for seq in engine._requests.values()):
        assert engine.has_unfinished_requests(), "no request was swapped out"
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    old_pool = engine.preemptor.pool
    fresh = LocalExecutor()
    engine.replace_executor(fresh, fresh.start(engine.setup_for(fresh)))
    assert old_pool.num_free_blocks == old_pool.num_total_blocks
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert list(tokens.values()) == expected


# ---- one served pipeline: a lost stage, a live remap, a failed remap ---------------------------------
async def _stream_all(async_engine, tag: str, on_token=None) -> dict[str, list[int]]:
    pairs = enumerate(zip(PROMPTS, _params(), strict=True))
    streams = [await async_engine.add(f"{tag}{i}", prompt, params) for i, (prompt, params) in pairs]
    tokens: dict[str, list[int]] = {}

    async def read(stream):
        got = tokens.setdefault(stream.request_id, [])
        async for out in stream:
            got.extend(out.new_token_ids)
            if on_token is not None:
                on_token(stream.request_id, len(got))

    await asyncio.wait_for(asyncio.gather(*(read(s) for s in streams)), DEADLINE_S)
    return tokens


def _when_all_started(count: int, action):
    """An `on_token` that runs `action` once every stream has `count` tokens."""
    seen: dict[str, int] = {}
    fired = threading.Event()

    def on_token(rid: str, n: int) -> None:
        seen[rid] = n
        if not fired.is_set() and len(seen) == len(PROMPTS) and min(seen.values()) >= count:
            fired.set()
            action()

    return on_token


@pytest.mark.slow
def test_served_pipeline_survives_a_lost_stage_and_remaps_live(tiny_dirs, tmp_path):
    """3 stages; stage 2 is killed while every request streams: the server re-plans on stages 0-1 and
    the requests finish with an undisturbed run's tokens. A live remap to another split while they
    stream moves them without a repeated or missing token. A remap whose new stage dies while
    loading rolls back: the old pipeline keeps serving, its requests intact."""
    from tessel.engine.llm_engine import LLM
    from tessel.pipeline.options import RunOptions
    from tessel.pipeline.supervision.supervisor import Supervisor
    from tessel.server.async_engine import AsyncEngine

    model = tiny_dirs["tied"]
    expected = [out.token_ids for out in LLM(model).generate(PROMPTS, _params(), use_progress=False)]
    plan3 = write_plan(tmp_path / "plan3.json", model, [(0, 2), (2, 4), (4, 5)])
    plan2 = write_plan(tmp_path / "plan2.json", model, [(0, 2), (2, 5)])
    engine = Supervisor.serve(RunOptions(plan3, model, heartbeat_timeout=10.0), max_rebuilds=3)
    supervisor, first = engine.supervisor, engine.executor
    async_engine = AsyncEngine(engine, max_pending=8)
    async_engine.start()
    pids = [proc.pid for proc in first.stages.procs]
    try:
        # a lost stage
        kill = lambda: os.kill(first.stages.procs[1].pid, signal.SIGKILL)  # noqa: E731
        lost = asyncio.run(_stream_all(async_engine, "lost", _when_all_started(4, kill)))
        assert list(lost.values()) == expected
        survivors = engine.executor
        assert survivors is not first and async_engine.last_recovery.moved == len(PROMPTS)
        assert [(s.device, s.layer_start, s.layer_end) for s in survivors.plan.stages] == [
            ("localhost/cpu0", 0, 3),
            ("localhost/cpu1", 3, 5),
        ]
        pids += [proc.pid for proc in survivors.stages.procs]
        assert list(asyncio.run(_stream_all(async_engine, "after")).values()) == expected

        # a live remap to another split: it loads beside; the switch waits until every stream runs
        loaded, go = threading.Event(), threading.Event()
        replacement = supervisor._replacement

        def gated(options):
            executor = replacement(options)
            wait = executor.wait_for_stages
            executor.wait_for_stages = lambda: (wait(), loaded.set(), go.wait(DEADLINE_S))[0]
            pids.extend(proc.pid for proc in executor.stages.procs)
            return executor

        supervisor._replacement = gated
        future = async_engine.remap(plan2, "test: another split")
        assert loaded.wait(DEADLINE_S)
        remapped = asyncio.run(_stream_all(async_engine, "remap", _when_all_started(4, go.set)))
        report = future.result(DEADLINE_S)
        assert list(remapped.values()) == expected
        assert report.ok and report.error is None and report.moved == len(PROMPTS)
        assert report.max_gap_s is not None and report.max_gap_s > 0
        third = engine.executor
        assert [(s.layer_start, s.layer_end) for s in third.plan.stages] == [(0, 2), (2, 5)]

        # a remap whose new stage dies while loading: rolled back, the old pipeline serves on
        def dying(options):
            executor = replacement(options)
            pids.extend(proc.pid for proc in executor.stages.procs)
            os.kill(executor.stages.procs[0].pid, signal.SIGKILL)
            return executor

        supervisor._replacement = dying
        failed = async_engine.remap(plan3, "test: a stage dies").result(DEADLINE_S)
        assert not failed.ok and failed.rolled_back
        assert "stage 1" in failed.error and "SIGKILL" in failed.error
        assert engine.executor is third and async_engine.healthy
        assert list(asyncio.run(_stream_all(async_engine, "rolled")).values()) == expected

        with pytest.raises(TesselError, match="does not exist"):
            async_engine.remap(tmp_path / "missing.json", "test: a bad plan").result(DEADLINE_S)
        assert engine.executor is third and supervisor.num_rebuilds == 1
    finally:
        async_engine.stop()
        supervisor.close()
        release(pids)


def test_survivors_too_small_fails_the_requests_with_the_reason_naming_the_stage(tiny_dirs, tmp_path):
    """A stage is lost and the survivors cannot hold the model: what was in flight ends with 503 and
    that reason, and the server says so (naming the stage) instead of serving; a remap is refused."""
    from tessel.engine.executor import LocalExecutor
    from tessel.engine.llm_engine import LLM
    from tessel.pipeline.options import RunOptions
    from tessel.pipeline.supervision.launcher import StageFailedError
    from tessel.pipeline.supervision.supervisor import Supervisor
    from tessel.server.async_engine import AsyncEngine
    from tessel.server.http_errors import EngineDeadError

    class LosingExecutor(LocalExecutor):
        def launch(self, micro_batch, kv_copies):
            raise StageFailedError(2, "killed by signal SIGKILL")

    too_small = load_plan(write_gpu_plan(tmp_path / "p.json", ["A100-80G", "T4", "T4"], "llama-2-70b", 80))
    engine = LLM(tiny_dirs["tied"], executor=LosingExecutor())
    supervisor = Supervisor(RunOptions(tmp_path / "p.json", tiny_dirs["tied"]), max_rebuilds=3)
    supervisor.attach(engine)
    supervisor._survivors_options = lambda old, error: survivor_plan(too_small, {2})  # 96 GiB left for 70B
    async_engine = AsyncEngine(engine, max_pending=4)
    async_engine.start()

    async def run() -> None:
        stream = await async_engine.add("r", PROMPTS[0], _params()[0])
        with pytest.raises(EngineDeadError, match="cannot hold the model") as caught:
            await stream.final()
        assert "losing stage 2 (n/gpu2)" in str(caught.value) and "SIGKILL" in str(caught.value)

    try:
        asyncio.run(run())
        reason = str(async_engine.unavailable())
        assert "cannot hold the model" in reason and "pipeline stage 2 failed" in reason
        with pytest.raises(TesselError, match="not a pipeline"):
            AsyncEngine(LLM(tiny_dirs["tied"]), max_pending=1).remap(tmp_path / "p.json", "test").result(5)
    finally:
        async_engine.stop()
