"""A plan file's stages priced by the cost model, checked against direct cost-model calls."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sim.sim_plans import TINY_LLAMA, write_plan
from tessel.catalog.gpus import get_gpu
from tessel.catalog.models import model_from_config
from tessel.cost import embed_time_s, lm_head_time_s, unit_decode_time_s, unit_prefill_time_s
from tessel.errors import TesselError
from tessel.plan.files.plan_file import load_plan
from tessel.sim.plan_pipeline import kv_capacity_tokens, pipeline_for
from tessel.sim.requests import Request
from tessel.sim.scheduler import SimSchedulerConfig
from tessel.sim.simulator import SimConfig, simulate

MODEL = model_from_config(TINY_LLAMA, name="tiny-llama", source="test")


def test_stage_times_are_sums_of_unit_times(tmp_path: Path) -> None:
    priced = pipeline_for(load_plan(write_plan(tmp_path)))
    rng = np.random.default_rng()
    c, p, b, s = (int(rng.integers(1, 4000)) for _ in range(4))
    layers = [4, 2, 2]
    gpus = ["A100-80G", "T4", "T4"]
    for j, stage in enumerate(priced.pipeline.stages):
        gpu = get_gpu(gpus[j])
        expected = layers[j] * unit_prefill_time_s(MODEL, gpu, "layer", c, p)
        expected += embed_time_s(MODEL, gpu, c) if j == 0 else 0.0
        assert stage.prefill_time_s(c, p) == pytest.approx(expected, rel=1e-12)
        expected = layers[j] * unit_decode_time_s(MODEL, gpu, "layer", b, s + b)
        expected += embed_time_s(MODEL, gpu, b) if j == 0 else 0.0
        expected += lm_head_time_s(MODEL, gpu, b) if j == 2 else 0.0
        assert stage.decode_time_s(b, s + b) == pytest.approx(expected, rel=1e-12)
    assert priced.logits_time_s(3) == lm_head_time_s(MODEL, get_gpu("T4"), 3)
    # 100 Gb/s and 5 us: fp16 hidden states of c tokens
    stages = priced.pipeline.stages
    assert stages[0].send_time_s(c) == pytest.approx(5e-6 + c * 1024 * 2 / (100e9 / 8), rel=1e-12)
    assert stages[2].send_time_s(c) == 0.0


def test_ttft_of_one_prompt_includes_the_lm_head_once(tmp_path: Path) -> None:
    priced = pipeline_for(load_plan(write_plan(tmp_path)))
    prompt, chunk = 1000, 256
    config = SimConfig(SimSchedulerConfig(max_num_batched_tokens=chunk), logits_time_s=priced.logits_time_s)
    record = simulate(priced.pipeline, [Request(0, 0.0, prompt, 1)], config).records[0]
    expected, offset = 0.0, 0
    while offset < prompt:  # one sequence, chunks in series: each crosses every stage and link
        size = min(chunk, prompt - offset)
        for stage in priced.pipeline.stages:
            expected += stage.prefill_time_s(size, offset) + stage.send_time_s(size)
        offset += size
    expected += priced.logits_time_s(1)
    assert record.ttft_s == pytest.approx(expected, rel=1e-12)


def test_baselines_get_their_own_split(tmp_path: Path) -> None:
    plan = load_plan(write_plan(tmp_path))
    (uniform,) = plan.baseline_variants
    assert uniform.name == "uniform" and plan.infeasible == {"petals_greedy": "does not fit"}
    main = pipeline_for(plan).pipeline.stages[0]
    base = pipeline_for(plan, uniform).pipeline.stages[0]
    assert main.prefill_time_s(512, 0) > base.prefill_time_s(512, 0)  # 4 layers against 3


def test_sublayer_plans_count_attention_and_mlp_blocks(tmp_path: Path) -> None:
    path = write_plan(tmp_path)
    data = json.loads(path.read_text())
    data["granularity"] = "sublayer"
    data.pop("baselines")  # their stages are layer units
    bounds = [(0, 7), (7, 12), (12, 16)]  # stage 0 ends inside layer 3, after its attention block
    for stage, (start, end) in zip(data["stages"], bounds, strict=True):
        stage.update(unit_start=start, unit_end=end, layer_start=start // 2, layer_end=(end + 1) // 2)
    path.write_text(json.dumps(data))
    priced = pipeline_for(load_plan(path))
    gpu = get_gpu("A100-80G")
    expected = 4 * unit_prefill_time_s(MODEL, gpu, "attention", 300, 10)
    expected += 3 * unit_prefill_time_s(MODEL, gpu, "mlp", 300, 10) + embed_time_s(MODEL, gpu, 300)
    assert priced.pipeline.stages[0].prefill_time_s(300, 10) == pytest.approx(expected, rel=1e-12)


def test_unknown_gpu_is_a_user_error(tmp_path: Path) -> None:
    path = write_plan(tmp_path)
    data = json.loads(path.read_text())
    data["stages"][1]["gpu_type"] = "GTX-280"
    path.write_text(json.dumps(data))
    with pytest.raises(TesselError):
        pipeline_for(load_plan(path))


@pytest.mark.parametrize("overlap", [False, True])
def test_offloaded_weights_are_streamed_in_every_batch(tmp_path: Path, overlap: bool) -> None:
    path = write_plan(tmp_path)
    data = json.loads(path.read_text())
    data["stages"][1]["offload_gib"] = 1.5
    data["overlap"] = overlap
    path.write_text(json.dumps(data))
    priced = pipeline_for(load_plan(path))
    offload = 1.5 * 1024**3 / get_gpu("T4").pcie_h2d_bytes_per_s
    assert priced.offload_s == (0.0, pytest.approx(offload, rel=1e-12), 0.0)
    assert priced.offload_overlap is overlap
    request = Request(0, 0.0, 700, 1)
    config = SimConfig(SimSchedulerConfig(max_num_batched_tokens=4096), logits_time_s=priced.logits_time_s)
    plain = simulate(priced.pipeline, [request], config).records[0].ttft_s
    config.offload_s, config.offload_overlap = priced.offload_s, priced.offload_overlap
    streamed = simulate(priced.pipeline, [request], config).records[0].ttft_s
    compute = priced.pipeline.stages[1].prefill_time_s(700, 0)
    extra = max(compute, offload) - compute if overlap else offload
    assert streamed - plain == pytest.approx(extra, rel=1e-9)


def test_a_profile_replaces_the_roofline_of_its_device_type(tmp_path: Path) -> None:
    from tessel.cost import DecodeFit, PrefillFit, Profile, profile_shape

    rng = np.random.default_rng()
    fit = PrefillFit(*(float(v) for v in rng.uniform(1e-6, 1e-4, 4)))
    profile = Profile("T4", profile_shape(MODEL), "fp16", fit, DecodeFit(1e-3, 1e-5, 1e-8), 0.01)
    priced = pipeline_for(load_plan(write_plan(tmp_path)), profiles=[profile])
    c, p = int(rng.integers(1, 3000)), int(rng.integers(0, 3000))
    assert priced.pipeline.stages[1].prefill_time_s(c, p) == pytest.approx(2 * fit.time_s(c, p), rel=1e-9)
    a100 = get_gpu("A100-80G")  # no profile for the A100: still the roofline
    expected = 4 * unit_prefill_time_s(MODEL, a100, "layer", c, p) + embed_time_s(MODEL, a100, c)
    assert priced.pipeline.stages[0].prefill_time_s(c, p) == pytest.approx(expected, rel=1e-12)


def test_kv_capacity_is_what_the_plan_reserved(tmp_path: Path) -> None:
    path = write_plan(tmp_path)
    plan = load_plan(path)
    per_token_layer = 2 * 4 * 64 * 2  # K and V, 4 KV heads of 64, fp16
    # every stage reserved 0.5 GiB per layer: the same token count on each
    assert kv_capacity_tokens(plan) == int(0.5 * 1024**3 // per_token_layer)
    data = json.loads(path.read_text())
    data["stages"][1]["kv_gib"] = 0.25  # 2 layers: 0.125 GiB per layer, the tightest
    path.write_text(json.dumps(data))
    assert kv_capacity_tokens(load_plan(path)) == int(0.125 * 1024**3 // per_token_layer)
    data["stages"][1]["kv_gib"] = 0.0
    path.write_text(json.dumps(data))
    assert kv_capacity_tokens(load_plan(path)) is None
