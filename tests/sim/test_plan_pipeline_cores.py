"""CPU stages of one host share its cores in the simulator by processor sharing: hand-counted
timelines (bubbles leave the cores to the computing stages; an emulated slow stage sleeps off the
cores, for (1/s - 1) x the wall time its shared compute took, as the runtime's emulation does)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tessel.catalog.models import load_model
from tessel.chunk.from_plan import PlanPipeline, StageSpec, build_pipeline
from tessel.chunk.latency import PipelineLatency
from tessel.cost import roofline as R
from tessel.cost.link import LinkSpec
from tessel.cost.profile import ComponentFit, DecodeFit, PrefillFit, Profile
from tessel.sim.linear import LinearStage
from tessel.sim.plan_pipeline import core_sharing
from tessel.sim.requests import Request
from tessel.sim.scheduler import SimSchedulerConfig
from tessel.sim.simulator import CoreSharing, SimConfig, simulate

T = 0.1  # a prompt's prefill on each stage, on a core of its own


def _finishes(times: list[float], cores: CoreSharing | None, requests: int) -> list[float]:
    """Finish times of `requests` one-token prompts, one per micro-batch (pinned slots), on stages
    whose prefill takes times[s] as priced."""
    pipeline = PipelineLatency(tuple(LinearStage(prefill_base_s=t) for t in times))
    config = SimConfig(SimSchedulerConfig(), max_in_flight=requests, pinned=requests > 1, cores=cores)
    result = simulate(pipeline, [Request(i, 0.0, 16, 1) for i in range(requests)], config)
    return [r.finish_s for r in result.records]


def test_one_prompt_has_the_cores_to_itself() -> None:
    # 3 stages on 2 cores, priced with the static factor 1.5: only one stage computes at a time
    cores = CoreSharing(("h",) * 3, {"h": 2.0}, (1.5,) * 3, (1.0,) * 3)
    assert _finishes([1.5 * T] * 3, cores, 1) == pytest.approx([3 * T])
    assert _finishes([1.5 * T] * 3, None, 1) == pytest.approx([4.5 * T])  # the static factor alone


def test_two_stages_computing_at_once_share_one_core() -> None:
    # A: stage 0 alone [0, T]; then A on stage 1 and B on stage 0 at half speed each until 3T;
    # B on stage 1 alone until 4T
    cores = CoreSharing(("h", "h"), {"h": 1.0}, (1.0, 1.0), (1.0, 1.0))
    assert _finishes([T, T], cores, 2) == pytest.approx([3 * T, 4 * T])
    assert _finishes([T, T], None, 2) == pytest.approx([2 * T, 3 * T])
    # one other program's thread wants the core all along: A alone at 1/2 until 2T; A and B at 1/3
    # until 5T; B alone at 1/2 until 7T
    loaded = CoreSharing(("h", "h"), {"h": 1.0}, (1.0, 1.0), (1.0, 1.0), {"h": 1.0})
    assert _finishes([T, T], loaded, 2) == pytest.approx([5 * T, 7 * T])


def test_an_emulated_stage_sleeps_off_the_core() -> None:
    # stage 1 emulates speed 0.5 (priced 2T, computes T of it): A computes on stage 1 beside B on
    # stage 0 at half speed [T, 3T], then sleeps that 2T wall x (1/0.5 - 1) until 5T; B waits for
    # stage 1, computes alone [5T, 6T] and sleeps T
    cores = CoreSharing(("h", "h"), {"h": 1.0}, (1.0, 1.0), (1.0, 0.5))
    assert _finishes([T, 2 * T], cores, 2) == pytest.approx([5 * T, 7 * T])
    # on cores of their own the sleep is what the price says: A at 3T, B at 5T
    assert _finishes([T, 2 * T], None, 2) == pytest.approx([3 * T, 5 * T])


def test_stages_computing_at_once_share_the_memory() -> None:
    # 2 cores, each stage slowed 1.5x while the other computes (contention 0.5 per stage beside it):
    # A alone on stage 0 [0, T]; A on stage 1 and B on stage 0 together at 1/1.5 until 2.5T; B alone
    # on stage 1 until 3.5T. One-token prompts are prefill batches: a decode-only slowdown leaves them.
    both = CoreSharing(("h", "h"), {"h": 2.0}, (1.0, 1.0), (1.0, 1.0), contention=((0.5, 0.5), (0.5, 0.5)))
    assert _finishes([T, T], both, 2) == pytest.approx([2.5 * T, 3.5 * T])
    decode_only = replace(both, contention=((0.5, 0.0), (0.5, 0.0)))
    assert _finishes([T, T], decode_only, 2) == pytest.approx([2 * T, 3 * T])
    assert _finishes([T, T], replace(both, contention=()), 2) == pytest.approx([2 * T, 3 * T])
    # one core: the two already take turns; the memory slows each the same while both hold it
    one_core = replace(both, slots={"h": 1.0})
    assert _finishes([T, T], one_core, 2) == pytest.approx([3 * T, 4 * T])
    with pytest.raises(ValueError, match="contention"):
        CoreSharing(("h", "h"), {"h": 2.0}, (1.0, 1.0), (1.0, 1.0), contention=((0.5, 0.5),))


def _priced(nodes: list[tuple[str, float]], profile: Profile) -> PlanPipeline:
    model = load_model("llama-2-7b")
    bounds = np.linspace(0, model.num_layers, len(nodes) + 1).astype(int)
    link = LinkSpec(10e9, 50e-6)
    stages = [
        StageSpec(f"{node}/cpu{i}", "cpu", int(bounds[i]), int(bounds[i + 1]),
                  link if i < len(nodes) - 1 else None, speed, node=node)
        for i, (node, speed) in enumerate(nodes)
    ]  # fmt: skip
    return build_pipeline(model, stages, dtype="fp32", kv_dtype="fp32", profiles=[profile])


def test_a_plans_cpu_stages_share_their_hosts_cores() -> None:
    profile = Profile(
        device_type="cpu",
        model_shape=R.L.profile_shape(load_model("llama-2-7b")),
        dtype="fp32",
        prefill=PrefillFit(1e-3, 1e-5, 1e-8, 1e-10),
        decode=DecodeFit(2e-3, 1e-4, 1e-8),
        heldout_rel_error=0.02,
        cpu_cores=2,
        threads=1,
    )
    cores = core_sharing(_priced([("a", 1.0), ("a", 1.0), ("a-slow", 0.5)], profile))
    assert cores == CoreSharing(("a", "a", "a"), {"a": 2.0}, (1.5, 1.5, 1.5), (1.0, 1.0, 0.5))
    assert core_sharing(_priced([("a", 1.0), ("b", 1.0)], profile)) is None  # a host each
    partly = core_sharing(_priced([("a", 1.0), ("a", 1.0), ("b", 1.0)], profile))
    assert partly is not None and partly.hosts == ("a", "a", None)
    loaded = core_sharing(_priced([("a", 1.0), ("b", 1.0)], profile), background_threads=1.5)
    assert loaded is not None and loaded.hosts == ("a", "b") and loaded.background == {"a": 1.5, "b": 1.5}
    # a profile that timed the layer beside a co-runner: its decode slowdown per stage beside it
    measured = replace(
        profile, components={"contention:decode": ComponentFit(1.0, 0.2, "co-runners", 0.0, 2)}
    )
    contended = core_sharing(_priced([("a", 1.0), ("a", 1.0), ("b", 1.0)], measured))
    assert contended is not None and contended.contention == ((0.2, 0.0), (0.2, 0.0), (0.0, 0.0))


def _gpu_priced(devices: list[str]) -> PlanPipeline:
    model = load_model("llama-2-7b")
    bounds = np.linspace(0, model.num_layers, len(devices) + 1).astype(int)
    link = LinkSpec(10e9, 50e-6)
    stages = [
        StageSpec(device, "H100", int(bounds[i]), int(bounds[i + 1]), link if i < len(devices) - 1 else None,
                  node=device.split("/")[0])
        for i, device in enumerate(devices)
    ]  # fmt: skip
    return build_pipeline(model, stages, dtype="fp16", kv_dtype="fp16")


def test_two_names_of_one_gpu_share_it() -> None:
    """`<node>/gpu<K>` and `<node>/gpu<K>#2` are one GPU: its stages share it as one full-speed slot
    (two computing at once each at half speed); two GPUs, or one GPU per node, share nothing; a lone
    GPU stage shares nothing with a CPU host's background threads."""
    shared = core_sharing(_gpu_priced(["n/gpu0", "n/gpu0#2", "n/gpu1"]), background_threads=2.0)
    key = ("gpu", "n", 0)
    assert shared is not None and shared.hosts == (key, key, None) and shared.slots == {key: 1.0}
    assert shared.background == {}
    assert core_sharing(_gpu_priced(["n/gpu0", "n/gpu1"])) is None
    assert core_sharing(_gpu_priced(["n/gpu0", "m/gpu0"])) is None
    # 8 prompts in flight through two stages on one GPU take as long as the GPU computing every
    # stage's batches one after another (processor sharing of one slot), transfers aside
    priced = _gpu_priced(["n/gpu0", "n/gpu0#2"])
    scheduler = SimSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)  # a prompt per batch
    config = SimConfig(scheduler, max_in_flight=2, cores=core_sharing(priced))
    requests = [Request(i, 0.0, 512, 1) for i in range(8)]
    one_by_one = sum(stage.prefill_time_s(512, 0) for stage in priced.pipeline.stages) * 8
    finish = max(r.finish_s for r in simulate(priced.pipeline, requests, config).records)
    sends = sum(stage.send_time_s(512) for stage in priced.pipeline.stages) * 8
    assert one_by_one <= finish <= one_by_one + sends + 1e-9
    apart = max(r.finish_s for r in simulate(priced.pipeline, requests, replace(config, cores=None)).records)
    assert apart < 0.75 * finish  # on two GPUs the stages overlap
