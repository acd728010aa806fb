"""Streamed weights (`tessel.engine.weight_stream`): which layers stream, the double buffer's
rotation and sizes (the CUDA path's logic, checked on the CPU), greedy outputs with half the layers
streamed against the in-memory engine (the oracle), the emulated host link's accounted seconds (byte
counts and bytes / bandwidth, never wall time), the planner marking offload on an emulated small
device and `tessel launch` running it, and the bad input refused before loading."""

from __future__ import annotations

import json
import math

import pytest
import torch

from loopback_stage import pipeline_llm
from pipeline_plans import write_plan
from tessel import LLM, SamplingParams
from tessel.engine.weight_stream import (
    ALIGN_BYTES,
    StreamSchedule,
    buffer_layout,
    check_offload,
    layer_weight_bytes,
)
from tessel.errors import TesselError
from tessel.models.config import ModelConfig
from tessel.pipeline.run_plan import load_run_plan
from tessel.plan.files.cluster import parse_cluster
from tessel.plan.files.plan_file import parse_plan
from tessel.plan.streamed import STREAM_BUFFERS, freed_bytes, offload_layers, streamed_count
from tessel.units import GBPS

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


# ---- which layers, which buffer, what order -----------------------------------------------------------
def _brute_count(layer_bytes: list[float], offload: float) -> int:
    """Fewest last layers whose streaming frees `offload` bytes, by trying every count."""
    for n in range(len(layer_bytes) + 1):
        tail = layer_bytes[len(layer_bytes) - n :]
        buffers = sum(sorted(tail, reverse=True)[:STREAM_BUFFERS])
        if offload <= 0 or sum(tail) - buffers >= offload:
            return n
    return len(layer_bytes)


@pytest.mark.parametrize("offload", [0.0, 1.0, 10.0, 25.0, 30.0, 1e9])
def test_streamed_layers_are_the_fewest_last_ones_that_free_the_offload(offload):
    layer_bytes = [10.0, 12.0, 10.0, 10.0, 11.0]
    n = streamed_count(layer_bytes, offload)
    assert n == _brute_count(layer_bytes, offload)
    assert offload_layers(7, layer_bytes, offload) == list(range(12 - n, 12))
    if 0 < offload <= freed_bytes(layer_bytes):
        assert freed_bytes(layer_bytes[len(layer_bytes) - n :]) >= offload


def test_double_buffer_rotation_copies_each_streamed_layer_into_alternate_buffers():
    schedule = StreamSchedule(0, 6, (2, 3, 4, 5))
    assert schedule.buffers == 2 and [schedule.buffer_of(i) for i in (2, 3, 4, 5)] == [0, 1, 0, 1]
    assert schedule.copies_before(0) == (2,)  # the first copy overlaps the resident layers 0 and 1
    assert schedule.copies_before(2) == (3,) and schedule.copies_before(5) == ()
    holders: list[int | None] = [None, None]
    first = schedule.step_copies(holders)
    assert first == [(2, 0), (3, 1), (4, 0), (5, 1)] and holders == [4, 5]
    assert schedule.step_copies(holders) == first  # an even count re-copies every layer each step


def test_odd_and_small_counts_keep_what_a_buffer_already_holds():
    odd = StreamSchedule(0, 3, (0, 1, 2))  # the first layer streams: layers 0 and 1 copied before it
    assert odd.copies_before(0) == (0, 1)
    holders: list[int | None] = [None, None]
    assert odd.step_copies(holders) == [(0, 0), (1, 1), (2, 0)]
    assert odd.step_copies(holders) == [(0, 0), (2, 0)]  # layer 1 stayed in buffer 1
    one = StreamSchedule(4, 8, (7,))
    assert one.buffers == 1
    holders = [None]
    assert one.step_copies(holders) == [(7, 0)] and one.step_copies(holders) == []
    with pytest.raises(ValueError):
        StreamSchedule(0, 4, (3, 2))


def test_buffer_layout_aligns_every_tensor_and_fits_the_largest_layer():
    offsets, total = buffer_layout([10, 1, 300, 256])
    assert offsets == [0, ALIGN_BYTES, 2 * ALIGN_BYTES, 4 * ALIGN_BYTES] and total == 4 * ALIGN_BYTES + 256
    assert all(offset % ALIGN_BYTES == 0 for offset in offsets)


# ---- a stage streaming half its layers -----------------------------------------------------------------
def _streaming_plan(tmp_path, model, streamed, host_gbps, name="plan.json"):
    plan = write_plan(tmp_path / name, model, [(0, 6)], micro_batches=1)
    document = json.loads(plan.read_text())
    document["stages"][0].update(offload_layers=streamed, emulate_host_gbps=host_gbps, host_gib=1.0)
    plan.write_text(json.dumps(document))
    return plan


def _run(model, plan) -> tuple[list[list[int]], LLM]:
    engine = pipeline_llm(model, plan)
    out = engine.generate(PROMPTS, GREEDY, use_progress=False)
    engine.executor.stage.streamer.close()
    return [o.token_ids for o in out], engine


def test_half_the_layers_streamed_give_the_in_memory_tokens_and_count_their_copies(tiny_dirs, tmp_path):
    model = tiny_dirs["untied"]
    expected = [o.token_ids for o in LLM(model).generate(PROMPTS, GREEDY, use_progress=False)]
    runs = {}
    for gbps in (2.0, 8.0):
        tokens, engine = _run(model, _streaming_plan(tmp_path, model, [3, 4, 5], gbps, f"p{gbps}.json"))
        assert tokens == expected
        runs[gbps] = engine.executor.stage
    stage = runs[8.0]
    stats, streamer = stage.stats, stage.streamer
    assert streamer.schedule.streamed == (3, 4, 5) and stats.stream_layers == 3
    # three streamed layers in two buffers: 3 copies in the first step, then 2 (layer 4 stays put)
    assert stats.stream_copies == 3 + 2 * (stats.batches - 1)
    per_layer = layer_weight_bytes(ModelConfig.from_dir(model), torch.float32)
    assert stats.stream_host_bytes == 3 * per_layer
    assert stats.stream_copy_bytes == stats.stream_copies * per_layer
    assert stats.stream_buffer_bytes == STREAM_BUFFERS * per_layer
    assert stats.stream_copy_s >= stats.stream_emulated_s  # the emulated link's time, or the copy's if longer
    assert 0.0 <= stats.stream_hidden_s <= stats.stream_copy_s
    slow, fast = runs[2.0].stats, runs[8.0].stats
    assert (slow.stream_copies, slow.stream_copy_bytes) == (fast.stream_copies, fast.stream_copy_bytes)
    for gbps, s in ((2.0, slow), (8.0, fast)):
        assert math.isclose(s.stream_emulated_s, s.stream_copy_bytes / (gbps * GBPS), rel_tol=1e-9)
    assert math.isclose(slow.stream_emulated_s / fast.stream_emulated_s, 4.0, rel_tol=1e-9)


def test_a_planned_small_device_streams_and_launch_runs_it(tiny_dirs, tmp_path):
    """`tessel plan` on a CPU emulating a device smaller than the model marks offloaded layers; a
    two-stage launch whose second stage is that plan's stage streams them, token for token."""
    from tessel.pipeline.run import RunOptions, run_pipeline
    from tessel.plan.api import PlanSettings, make_plan

    model = tiny_dirs["untied"]
    cluster = tmp_path / "small.yaml"
    cluster.write_text(
        "name: emulated-small\nnodes:\n  - name: n\n    gpus: {type: cpu}\n    host_memory_gib: 1\n"
        "    emulate: {memory_gib: 0.0009, host_gbps: 8}\n"
    )
    workload = tmp_path / "w.yaml"
    workload.write_text(
        "name: w\nprompt_tokens: {mean: 32, max: 64}\noutput_tokens: {mean: 16, max: 32}\n"
        "arrival_rate_per_s: 1\nmax_micro_batch: 1\n"
    )
    settings = PlanSettings(dtype="fp32", kv_dtype="fp32")
    stage = make_plan(str(model), str(cluster), str(workload), settings).plan_file().stages[0].model_dump()
    assert stage["offload_gib"] > 0 and stage["offload_layers"] and stage["emulate_host_gbps"] == 8
    streamed = stage["offload_layers"]
    assert streamed[-1] == 5 and len(streamed) < 6
    plan = write_plan(tmp_path / "launch.json", model, [(0, 2), (2, 6)], micro_batches=2)
    document = json.loads(plan.read_text())
    document["stages"][1].update({k: stage[k] for k in ("offload_layers", "emulate_host_gbps", "host_gib")})
    document["stages"][1]["offload_layers"] = [i for i in streamed if i >= 2]
    plan.write_text(json.dumps(document))
    run = run_pipeline(RunOptions(plan, model, prompts=PROMPTS, max_tokens=10, ignore_eos=True))
    expected = [o.token_ids for o in LLM(model).generate(PROMPTS, GREEDY, use_progress=False)]
    assert [r["token_ids"] for r in run.requests] == expected
    later = run.stages[1]
    assert later["stream_layers"] == len(document["stages"][1]["offload_layers"])
    assert later["stream_copies"] > 0
    assert run.stages[0]["stream_layers"] == 0


# ---- bad input --------------------------------------------------------------------------------------
def _stage(tmp_path, model, **fields):
    plan = _streaming_plan(tmp_path, model, [3, 4, 5], 8.0)
    document = json.loads(plan.read_text())
    document["stages"][0].update(fields)
    return document


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "fast"])
def test_a_plan_with_a_host_link_of_zero_or_nan_is_refused(tiny_dirs, tmp_path, value):
    document = _stage(tmp_path, tiny_dirs["untied"], emulate_host_gbps=value)
    with pytest.raises(TesselError, match="emulate_host_gbps is .*positive number of Gbit/s"):
        parse_plan(document)


@pytest.mark.parametrize("value", [0, float("nan")])
def test_a_cluster_with_a_host_link_of_zero_or_nan_is_refused(value):
    data = {"name": "x", "nodes": [{"name": "n", "gpus": {"type": "cpu"}, "emulate": {"host_gbps": value}}]}
    with pytest.raises(TesselError, match="host_gbps"):
        parse_cluster(data)


def test_offloaded_bytes_above_host_memory_are_refused(tiny_dirs, tmp_path):
    model = tiny_dirs["untied"]
    with pytest.raises(TesselError, match="offloads 2.000 GiB but its host memory is 1.000 GiB"):
        parse_plan(_stage(tmp_path, model, offload_gib=2.0, host_gib=1.0))
    plan = load_run_plan(_streaming_plan(tmp_path, model, [3, 4, 5], 8.0))
    config = ModelConfig.from_dir(model)
    stages = [_replace(plan.stages[0], host_gib=1e-6)]
    with pytest.raises(TesselError, match=r"3 streamed layers hold .* GiB in host memory, above the 1e-06"):
        check_offload(stages, config, torch.float32)


def test_a_memory_cap_below_one_layer_is_refused(tiny_dirs, tmp_path):
    model = tiny_dirs["untied"]
    plan = load_run_plan(_streaming_plan(tmp_path, model, [3, 4, 5], 8.0))
    config = ModelConfig.from_dir(model)
    per_layer_gib = layer_weight_bytes(config, torch.float32) / 2**30
    with pytest.raises(TesselError, match="below one decoder layer's weights"):
        check_offload([_replace(plan.stages[0], emulate_memory_gib=per_layer_gib / 2)], config, torch.float32)
    with pytest.raises(TesselError, match="stay on the device .* above its emulated"):
        check_offload([_replace(plan.stages[0], emulate_memory_gib=per_layer_gib * 4)], config, torch.float32)
    check_offload([_replace(plan.stages[0], emulate_memory_gib=per_layer_gib * 5.5)], config, torch.float32)


def _replace(stage, **fields):
    from dataclasses import replace

    return replace(stage, **fields)


def test_older_plans_load_and_an_offload_without_layers_gets_the_planners_layers(tiny_dirs, tmp_path):
    model = tiny_dirs["untied"]
    plain = load_run_plan(write_plan(tmp_path / "v1.json", model, [(0, 2), (2, 6)]))
    assert [s.offload_layers for s in plain.stages] == [(), ()] and plain.stages[1].emulate_host_gbps is None
    document = _stage(tmp_path, model, offload_gib=1e-4)
    del document["stages"][0]["offload_layers"]
    path = tmp_path / "derived.json"
    path.write_text(json.dumps(document))
    derived = load_run_plan(path).stages[0]
    spec = load_run_plan(path).plan_file.model_spec
    from tessel.cost.layer import weight_bytes

    per_layer = weight_bytes(spec, "layer", "fp32")
    assert derived.offload_layers == tuple(offload_layers(0, [per_layer] * 6, 1e-4 * 2**30))
    assert derived.offload_layers[-1] == 5


def test_a_cluster_emulating_a_small_device_plans_its_memory_and_host_link():
    data = {
        "name": "x",
        "nodes": [{"name": "n", "gpus": {"type": "cpu"}, "emulate": {"memory_gib": 0.25, "host_gbps": 8}}],
    }
    device = parse_cluster(data).devices[0]
    assert device.spec.usable_bytes == int(0.25 * 2**30)
    assert device.spec.pcie_h2d_bytes_per_s == device.spec.pcie_d2h_bytes_per_s == 8 * GBPS
    assert (device.emulate_memory_gib, device.emulate_host_gbps) == (0.25, 8)


def test_planning_on_an_emulated_memory_below_one_layer_is_refused(tiny_dirs, tmp_path):
    from tessel.plan.api import PlanSettings, make_plan

    cluster = tmp_path / "tiny.yaml"
    cluster.write_text(
        "name: too-small\nnodes:\n  - name: n\n    gpus: {type: cpu}\n    host_memory_gib: 1\n"
        "    emulate: {memory_gib: 0.00001, host_gbps: 8}\n"
    )
    with pytest.raises(TesselError, match="emulated memory of 1e-05 GiB is below one decoder layer"):
        make_plan(str(tiny_dirs["untied"]), str(cluster), "default", PlanSettings(dtype="fp32"))
