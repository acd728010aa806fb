"""Pricing a plan's stages with the cost model: the numpy twin against the scalar cost model."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from tessel.catalog.gpus import get_gpu
from tessel.catalog.models import load_model
from tessel.chunk.from_plan import (
    CostModelStage,
    StageSpec,
    build_pipeline,
    even_split_pipeline,
    load_plan_pipeline,
)
from tessel.chunk.planner import ChunkProblem, plan_chunks
from tessel.chunk.schedule import evaluate_chunks
from tessel.cost import LinkSpec, hidden_bytes, link_time_s, unit_decode_time_s, unit_prefill_time_s
from tessel.cost.layer import profile_shape
from tessel.cost.profile import PREFILL_BATCH, ComponentFit, DecodeFit, PrefillFit, Profile
from tessel.errors import TesselError
from tessel.plan.files.cluster import load_cluster


def _random_points(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    c = rng.integers(1, 40000, n)
    p = rng.integers(0, 130000, n)
    return c, p


@pytest.mark.parametrize(
    "model_name,gpu_name,dtype,units",
    [
        ("llama-3-70b", "A100-80G", "fp16", (("layer", 7),)),
        ("llama-3-8b", "T4", "int8", (("attention", 3), ("mlp", 2))),
        ("mixtral-8x7b", "H100", "bf16", (("layer", 4),)),
        ("opt-30b", "V100-32G", "fp16", (("mlp", 1),)),
    ],
)
def test_vectorised_stage_equals_scalar_cost_model(model_name, gpu_name, dtype, units) -> None:
    rng = np.random.default_rng(1)
    model, gpu = load_model(model_name), get_gpu(gpu_name)
    for first in (True, False):
        stage = CostModelStage.build(
            model=model,
            gpu=gpu,
            unit_counts=units,
            first=first,
            last=False,
            dtype=dtype,
            link=LinkSpec(25e9 / 8, 20e-6),
        )
        assert stage.twin_ok
        c, p = _random_points(rng, 200)
        scalar = np.array([stage.prefill_time_s(int(a), int(b)) for a, b in zip(c, p, strict=True)])
        np.testing.assert_allclose(stage.prefill_times_s(c, p), scalar, rtol=1e-9)
        # and the scalar stage is the cost model itself
        expected = sum(n * unit_prefill_time_s(model, gpu, k, 100, 500, dtype=dtype) for k, n in units)
        if not first:
            assert stage.prefill_time_s(100, 500) == pytest.approx(expected, rel=1e-12)
        sends = stage.send_times_s(c)
        assert sends[0] == pytest.approx(
            link_time_s(stage.link, hidden_bytes(model, int(c[0]), "fp16")), rel=1e-12
        )


def test_profile_replaces_the_roofline_in_both_paths() -> None:
    rng = np.random.default_rng(2)
    model, gpu = load_model("llama-3-8b"), get_gpu("A100-80G")
    profile = Profile(
        "A100-80G",
        profile_shape(model),
        "fp16",
        PrefillFit(1e-4, 2e-7, 1e-10, 3e-11),
        DecodeFit(1e-4, 1e-6, 1e-9),
        0.05,
    )
    plain = CostModelStage.build(model=model, gpu=gpu, unit_counts=(("layer", 4),), first=False, last=True)
    profiled = CostModelStage.build(
        model=model,
        gpu=gpu,
        unit_counts=(("attention", 2), ("mlp", 2)),
        first=False,
        last=True,
        profile=profile,
    )
    c, p = _random_points(rng, 100)
    scalar = np.array([profiled.prefill_time_s(int(a), int(b)) for a, b in zip(c, p, strict=True)])
    np.testing.assert_allclose(profiled.prefill_times_s(c, p), scalar, rtol=1e-9)
    # two attention + two MLP blocks under the profile make two whole profiled layers
    assert profiled.prefill_time_s(1000, 3000) == pytest.approx(
        2 * profile.prefill.time_s(1000, 3000), rel=1e-9
    )
    assert plain.prefill_time_s(1000, 3000) != pytest.approx(profiled.prefill_time_s(1000, 3000), rel=1e-3)


def _plan_document(model_name: str, gpus: list[str], splits: list[int]) -> dict:
    stages, start = [], 0
    for index, (gpu, end) in enumerate(zip(gpus, splits, strict=True)):
        link = None if index == len(gpus) - 1 else {"bandwidth_gbps": 100.0, "latency_us": 10.0}
        stages.append(
            {
                "index": index,
                "device": f"n/gpu{index}",
                "gpu_type": gpu,
                "node": "n",
                "layer_start": start,
                "layer_end": end,
                "unit_start": start,
                "unit_end": end,
                "link_to_next": link,
            }
        )
        start = end
    return {
        "version": 1,
        "model": {"name": model_name},
        "cluster": {"name": "hand"},
        "dtype": "fp16",
        "kv_dtype": "fp16",
        "granularity": "layer",
        "stages": stages,
    }


def test_plan_file_pipeline(tmp_path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan_document("llama-3-8b", ["A100-80G", "V100-32G", "T4"], [14, 26, 32])))
    priced = load_plan_pipeline(path)
    assert priced.pipeline.n_stages == 3 and priced.tail_s > 0
    model = load_model("llama-3-8b")
    first = priced.pipeline.stages[0]
    expected = 14 * unit_prefill_time_s(model, get_gpu("A100-80G"), "layer", 512, 1024)
    assert first.prefill_time_s(512, 1024) > expected  # + the embedding gather
    assert priced.pipeline.stages[-1].send_time_s(512) == 0.0
    assert first.send_time_s(512) == pytest.approx(10e-6 + 512 * 4096 * 2 / (100e9 / 8), rel=1e-12)
    plan = plan_chunks(ChunkProblem(priced.pipeline, (8192,), 64, tail_s=priced.tail_s))
    again = evaluate_chunks(priced.pipeline, list(plan.chunks), tail_s=priced.tail_s)
    assert plan.ttft_s == pytest.approx(again.ttft_s, rel=1e-12)


def test_malformed_plans_are_user_errors(tmp_path) -> None:
    path = tmp_path / "plan.json"
    with pytest.raises(TesselError, match="does not exist"):
        load_plan_pipeline(path)
    path.write_text("{not json")
    with pytest.raises(TesselError, match="not valid JSON"):
        load_plan_pipeline(path)
    path.write_text(json.dumps(_plan_document("llama-3-8b", ["A100-80G", "T4"], [10, 30])))
    with pytest.raises(TesselError, match="cover"):
        load_plan_pipeline(path)
    document = _plan_document("llama-3-8b", ["A100-80G", "T4"], [10, 32])
    del document["stages"][0]["gpu_type"]
    path.write_text(json.dumps(document))
    with pytest.raises(TesselError, match="malformed"):
        load_plan_pipeline(path)


def test_even_split_on_a_bundled_cluster() -> None:
    model, cluster = load_model("llama-3-70b"), load_cluster("mixed-a100-v100-t4")
    priced = even_split_pipeline(model, cluster, 4)
    assert [s.unit_end - s.unit_start for s in priced.stages] == [20, 20, 20, 20]
    assert [s.gpu_type for s in priced.stages] == [d.gpu_type for d in cluster.devices[:4]]
    assert priced.stages[-1].link is None and priced.stages[0].link is not None
    with pytest.raises(TesselError, match="--stages"):
        even_split_pipeline(model, cluster, 99)
    stages = [StageSpec("a", "A100-80G", 0, 40, None), StageSpec("b", "A100-80G", 40, 80, None)]
    with pytest.raises(TesselError, match="no link"):
        build_pipeline(model, stages)


def test_sublayer_plan_counts_attention_and_mlp_blocks(tmp_path) -> None:
    """Units 2i (attention) and 2i+1 (MLP): a stage may start or end mid-layer."""
    document = _plan_document("llama-3-8b", ["A100-80G", "A100-80G"], [23, 64])
    document["granularity"] = "sublayer"
    for stage in document["stages"]:  # units 0..23 hold layers 0..11, units 23..64 layers 11..31
        stage.update(layer_start=stage["unit_start"] // 2, layer_end=(stage["unit_end"] + 1) // 2)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(document))
    priced = load_plan_pipeline(path)
    first, second = priced.pipeline.stages
    assert first.unit_counts == (("attention", "fp16", 12), ("mlp", "fp16", 11))
    assert second.unit_counts == (("attention", "fp16", 20), ("mlp", "fp16", 21))
    model, gpu = load_model("llama-3-8b"), get_gpu("A100-80G")
    layer = unit_prefill_time_s(model, gpu, "layer", 256, 512)
    blocks = unit_prefill_time_s(model, gpu, "attention", 256, 512) + unit_prefill_time_s(
        model, gpu, "mlp", 256, 512
    )
    total = first.prefill_time_s(256, 512) - first._embed_time_s(256) + second.prefill_time_s(256, 512)
    assert total == pytest.approx(32 * blocks, rel=1e-12)
    assert blocks >= layer * 0.9  # split blocks cost about a layer (more launches, same work)


@pytest.mark.parametrize(
    "model_name,gpu_name,groups",
    [
        ("llama-3-8b", "T4", (("attention", "int8", 3), ("mlp", "int4", 2), ("attention", "fp16", 1))),
        ("mixtral-8x7b", "H100", (("layer", "int4", 2), ("layer", "bf16", 1), ("layer", "int8", 1))),
        ("opt-30b", "V100-32G", (("layer", "fp32", 1), ("layer", "int8", 2))),
    ],
)
def test_mixed_precision_stage_twin_equals_the_cost_model(model_name, gpu_name, groups) -> None:
    """(kind, precision, count) groups: the numpy twin equals the scalar path, and the scalar path is
    the cost model's unit time at each group's precision."""
    rng = np.random.default_rng(3)
    model, gpu = load_model(model_name), get_gpu(gpu_name).emulated(0.5)
    stage = CostModelStage.build(model=model, gpu=gpu, unit_counts=groups, first=False, last=False)
    assert stage.twin_ok
    c, p = _random_points(rng, 200)
    scalar = np.array([stage.prefill_time_s(int(a), int(b)) for a, b in zip(c, p, strict=True)])
    np.testing.assert_allclose(stage.prefill_times_s(c, p), scalar, rtol=1e-9)
    expected = sum(n * unit_prefill_time_s(model, gpu, k, 300, 900, dtype=q) for k, q, n in groups)
    assert stage.prefill_time_s(300, 900) == pytest.approx(expected, rel=1e-12)
    expected = sum(n * unit_decode_time_s(model, gpu, k, 5, 4000, dtype=q) for k, q, n in groups)
    assert stage.decode_time_s(5, 4000) == pytest.approx(expected, rel=1e-12)


def test_each_precision_gets_its_own_profile() -> None:
    """An int8 profile prices the int8 units and an fp16 profile the fp16 ones (as the planner picks a
    profile per precision), in both paths."""
    model, gpu = load_model("llama-3-8b"), get_gpu("A100-80G")

    def profile(dtype: str, scale: float) -> Profile:
        fits = PrefillFit(1e-4 * scale, 2e-7 * scale, 1e-10, 3e-11 * scale), DecodeFit(1e-4, 1e-6, 1e-9)
        return Profile("A100-80G", profile_shape(model), dtype, *fits, 0.05)

    fp16, int8 = profile("fp16", 1.0), profile("int8", 0.5)
    groups = (("layer", "fp16", 2), ("layer", "int8", 3))
    stage = CostModelStage.build(
        model=model, gpu=gpu, unit_counts=groups, first=False, last=True, profile=fp16, profiles=(fp16, int8)
    )
    assert stage.twin_ok and stage.profile_for("int8") is int8 and stage.profile_for("fp16") is fp16
    expected = 2 * fp16.prefill.time_s(1000, 3000) + 3 * int8.prefill.time_s(1000, 3000)
    assert stage.prefill_time_s(1000, 3000) == pytest.approx(expected, rel=1e-9)
    c, p = _random_points(np.random.default_rng(4), 100)
    scalar = np.array([stage.prefill_time_s(int(a), int(b)) for a, b in zip(c, p, strict=True)])
    np.testing.assert_allclose(stage.prefill_times_s(c, p), scalar, rtol=1e-9)


def test_unknown_precision_in_a_stage_is_a_user_error() -> None:
    model = load_model("llama-3-8b")
    with pytest.raises(TesselError, match="unknown dtype 'int3'"):
        CostModelStage.build(
            model=model, gpu=get_gpu("T4"), unit_counts=(("layer", "int3", 1),), first=True, last=True
        )
    stages = [StageSpec("a", "T4", 0, 32, None, precisions=("int8",) * 31)]
    with pytest.raises(TesselError, match="31 precisions for 32 units"):
        build_pipeline(model, stages)


def test_a_pass_over_several_prompts_pays_the_shared_part_once() -> None:
    """n prompts' chunks in one pass: every chunk's time less (n - 1) x what a pass pays once (the
    profile's `prefill_batch` intercept, per layer), never less than the longest chunk alone; without
    that component, the prefill fit's intercept a0; in the planner's batched price (unit_prefill_time_s)
    the same."""
    model, gpu = load_model("llama-3-8b"), get_gpu("A100-80G")
    fit = PrefillFit(1e-3, 2e-7, 1e-10, 3e-11)
    batch = ComponentFit(4e-4, 9e-4, "sequences", 0.01, 10, {"chunk_tokens": 32})
    plain = Profile("A100-80G", profile_shape(model), "fp16", fit, DecodeFit(1e-4, 1e-6, 1e-9), 0.05)
    timed = replace(plain, components={PREFILL_BATCH: batch})
    chunks = [(100, 0), (30, 50), (7, 0)]
    for profile, shared_s in ((timed, 4e-4), (plain, 1e-3)):
        stage = CostModelStage.build(
            model=model, gpu=gpu, unit_counts=(("layer", 4),), first=False, last=True, profile=profile
        )
        alone = sum(4 * fit.time_s(c, p) for c, p in chunks)
        assert stage.prefill_pass_time_s(chunks) == pytest.approx(alone - 2 * 4 * shared_s, rel=1e-9)
        assert stage.prefill_pass_time_s(chunks[:1]) == pytest.approx(stage.prefill_time_s(100, 0), rel=1e-12)
        batched = unit_prefill_time_s(model, gpu, "layer", 64, 0, batch_size=5, dtype="fp16", profile=profile)
        assert batched == pytest.approx(5 * fit.time_s(64, 0) - 4 * shared_s, rel=1e-9)
    huge = replace(plain, components={PREFILL_BATCH: replace(batch, c0=1.0)})  # never below one chunk
    stage = CostModelStage.build(
        model=model, gpu=gpu, unit_counts=(("layer", 4),), first=False, last=True, profile=huge
    )
    assert stage.prefill_pass_time_s(chunks) == pytest.approx(stage.prefill_time_s(100, 0), rel=1e-12)
