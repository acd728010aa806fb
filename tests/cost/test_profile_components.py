"""The profile's other priced components: their fits (against the generating law), their file format
(v2 round trip, v1 still read, bad files refused naming what is wrong) and their use by the cost
model, the chunk planner's stages and the simulator."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from tessel.catalog.gpus import get_gpu
from tessel.catalog.models import load_model
from tessel.chunk.from_plan import StageSpec, build_pipeline, core_share, hop_transport, stage_hosts
from tessel.cost import roofline as R
from tessel.cost.fit import fit_component
from tessel.cost.link import LinkSpec
from tessel.cost.profile import ComponentFit, DecodeFit, PrefillFit, Profile, load_profile
from tessel.errors import TesselError
from tessel.profiling.components import transports_for
from tessel.sim import SimConfig, SimSchedulerConfig, compute_metrics, simulate
from tessel.sim.requests import Request

SIZES = np.array([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64], float)


def test_affine_fit_recovers_the_law_and_reports_heldout_error() -> None:
    rng = np.random.default_rng(0)
    times = 2e-3 + 5e-4 * SIZES
    exact = fit_component(SIZES, times, "rows")
    assert exact.c0 == pytest.approx(2e-3, rel=1e-9) and exact.c1 == pytest.approx(5e-4, rel=1e-9)
    assert exact.heldout_rel_error < 1e-9 and exact.n_points == len(SIZES)
    noisy = fit_component(SIZES, times * rng.uniform(0.9, 1.1, len(SIZES)), "rows")
    assert 0 < noisy.heldout_rel_error < 0.1  # noise of +-10% shows in the held-out points


def test_table_fit_follows_a_kink_an_affine_fit_misses() -> None:
    x = np.array([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024], float)
    times = 1e-5 + np.where(x < 100, 2e-8 * x, 2e-6 + 3e-7 * (x - 100))  # slope x15 past "the cache"
    table = fit_component(x, times, "tokens", table=True)
    affine = fit_component(x, times, "tokens")
    assert table.heldout_rel_error < affine.heldout_rel_error
    assert table.time_s(2048) == pytest.approx(1e-5 + 2e-6 + 3e-7 * 1948, rel=1e-9)  # last segment, extended
    assert table.time_s(x[0]) == pytest.approx(times[0])
    with pytest.raises(ValueError, match="distinct"):
        fit_component(np.array([1, 1, 2, 3, 4, 5, 6], float), np.ones(7), "tokens")


def _profile(**components: ComponentFit) -> Profile:
    model = load_model("llama-2-7b")
    return Profile(
        device_type="cpu",
        model_shape=R.L.profile_shape(model),
        dtype="fp32",
        prefill=PrefillFit(1e-3, 1e-5, 1e-8, 1e-10),
        decode=DecodeFit(2e-3, 1e-4, 1e-8),
        heldout_rel_error=0.02,
        components=dict(components),
        cpu_cores=2,
        threads=1,
    )


def _fit(c0: float, c1: float, unit: str, shape: dict | None = None) -> ComponentFit:
    return ComponentFit(c0, c1, unit, 0.01, 12, shape or {})


def _ends_shape() -> dict:
    model = load_model("llama-2-7b")
    return {"hidden_size": model.hidden_size, "vocab_size": model.vocab_size}


def test_profile_v2_round_trips_and_v1_still_loads(tmp_path) -> None:
    profile = _profile(
        embed=replace(_fit(1e-5, 1e-7, "tokens", _ends_shape()), knots=[(1.0, 1e-5), (8.0, 2e-5)]),
        head=_fit(9e-3, 5e-4, "rows", _ends_shape()),
        step=_fit(4e-4, 3e-5, "sequences"),
        **{"transport:host": _fit(1.5e-4, 3e-10, "bytes")},
    )
    path = tmp_path / "p.json"
    profile.save(path)
    assert load_profile(path) == replace(profile, meta=profile.to_json()["meta"])  # + the writer's version
    data = json.loads(path.read_text())
    for key in ("components", "cpu_cores", "threads"):
        data.pop(key)
    (tmp_path / "v1.json").write_text(json.dumps(data | {"version": 1}))
    old = load_profile(tmp_path / "v1.json")
    assert old.components == {} and old.cpu_cores is None and old.decode == profile.decode


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version=3), "versions 1, 2"),
        (lambda d: d.update(version="2"), "versions 1, 2"),
        (lambda d: d["components"].update(lm_tail=d["components"]["step"]), "unknown profile component"),
        (lambda d: d["components"]["step"].update(c1=-1.0), "c1"),
        (lambda d: d["components"]["embed"].update(knots=[[8.0, 1e-5], [1.0, 2e-5]]), "increasing"),
        (lambda d: d.update(cpu_cores=0), "cpu_cores"),
    ],
)
def test_bad_profiles_are_refused_naming_what_is_wrong(tmp_path, edit, message) -> None:
    profile = _profile(
        embed=replace(_fit(1e-5, 1e-7, "tokens", _ends_shape()), knots=[(1.0, 1e-5), (8.0, 2e-5)]),
        step=_fit(4e-4, 3e-5, "sequences"),
    )
    data = profile.to_json()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TesselError, match=message):
        load_profile(path)


def test_truncated_and_non_finite_profiles_are_refused(tmp_path) -> None:
    text = json.dumps(_profile(step=_fit(4e-4, 3e-5, "sequences")).to_json())
    (tmp_path / "cut.json").write_text(text[: len(text) // 2])
    with pytest.raises(TesselError, match="cut.json"):
        load_profile(tmp_path / "cut.json")
    (tmp_path / "nan.json").write_text(text.replace("0.0004", "NaN"))
    with pytest.raises(TesselError, match="nan.json"):
        load_profile(tmp_path / "nan.json")


def test_cost_model_prices_the_ends_step_and_transport_from_the_profile() -> None:
    model, cpu = load_model("llama-2-7b"), get_gpu("cpu")
    head, embed = _fit(9e-3, 5e-4, "rows", _ends_shape()), _fit(1e-5, 1e-7, "tokens", _ends_shape())
    profile = _profile(head=head, embed=embed, step=_fit(4e-4, 3e-5, "sequences"))
    assert R.lm_head_time_s(model, cpu, 8, "fp32", profile=profile) == pytest.approx(head.time_s(8))
    assert R.embed_time_s(model, cpu, 100, "fp32", profile=profile) == pytest.approx(embed.time_s(100))
    assert R.step_overhead_s(cpu, 8, "fp32", profile=profile) == pytest.approx(4e-4 + 8 * 3e-5)
    # an emulated half-speed copy computes the ends at half speed; its host work is not stretched
    slow = cpu.emulated(0.5)
    assert R.lm_head_time_s(model, slow, 8, "fp32", profile=profile) == pytest.approx(2 * head.time_s(8))
    assert R.step_overhead_s(slow, 8, "fp32", profile=profile) == pytest.approx(4e-4 + 8 * 3e-5)
    # another vocabulary, dtype or device: the roofline, and no step term
    other = load_model("llama-3-8b")
    assert R.lm_head_time_s(other, cpu, 8, "fp32", profile=profile) == R.lm_head_time_s(other, cpu, 8, "fp32")
    assert R.lm_head_time_s(model, cpu, 8, "fp16", profile=profile) == R.lm_head_time_s(model, cpu, 8, "fp16")
    assert R.step_overhead_s(get_gpu("A100-80G"), 8, "fp32", profile=profile) == 0.0
    assert R.step_overhead_s(cpu, 8, "fp32") == 0.0


def _stages(nodes: list[tuple[str, float]], layers: int) -> list[StageSpec]:
    bounds = np.linspace(0, layers, len(nodes) + 1).astype(int)
    link = LinkSpec(10e9, 50e-6)
    return [
        StageSpec(f"{node}/gpu{i}", "cpu", int(bounds[i]), int(bounds[i + 1]),
                  link if i < len(nodes) - 1 else None, speed, node=node)
        for i, (node, speed) in enumerate(nodes)
    ]  # fmt: skip


def test_cpu_stages_on_one_host_share_its_cores() -> None:
    model = load_model("llama-2-7b")
    profile = _profile(**{"transport:host": _fit(2e-4, 1e-9, "bytes")})
    two = _stages([("a", 1.0), ("a", 1.0)], model.num_layers)
    three = _stages([("a", 1.0), ("a", 1.0), ("a-slow", 0.5)], model.num_layers)  # emulated: on a's host
    apart = _stages([("a", 1.0), ("b", 1.0), ("c", 1.0)], model.num_layers)
    assert stage_hosts(three) == ["a", "a", "a"] and stage_hosts(apart) == ["a", "b", "c"]
    assert [core_share(two, stage_hosts(two), i, profile) for i in range(2)] == [1.0, 1.0]
    assert [core_share(three, stage_hosts(three), i, profile) for i in range(3)] == [1.5] * 3
    assert [core_share(apart, stage_hosts(apart), i, profile) for i in range(3)] == [1.0] * 3
    assert core_share(three, stage_hosts(three), 0, replace(profile, cpu_cores=None)) == 1.0
    shared = build_pipeline(model, three, dtype="fp32", kv_dtype="fp32", profiles=[profile]).pipeline.stages
    alone = build_pipeline(model, apart, dtype="fp32", kv_dtype="fp32", profiles=[profile]).pipeline.stages
    assert shared[1].decode_time_s(4, 400) == pytest.approx(1.5 * alone[1].decode_time_s(4, 400))
    assert shared[0].prefill_time_s(64, 0) == pytest.approx(1.5 * alone[0].prefill_time_s(64, 0))
    # a hop within the host is the profiled message; between hosts the cluster's link
    n_bytes = R.L.hidden_bytes(model, 4, "fp32")
    assert shared[0].send_time_s(4) == pytest.approx(2e-4 + 1e-9 * n_bytes)
    assert alone[0].send_time_s(4) == pytest.approx(50e-6 + n_bytes / 10e9)


def test_simulator_adds_the_step_overhead_once_per_batch_on_the_first_stage() -> None:
    model = load_model("llama-2-7b")
    step = _fit(5e-3, 1e-3, "sequences")
    stages = _stages([("a", 1.0), ("b", 1.0)], model.num_layers)
    with_step = build_pipeline(model, stages, dtype="fp32", kv_dtype="fp32", profiles=[_profile(step=step)])
    without = build_pipeline(model, stages, dtype="fp32", kv_dtype="fp32", profiles=[_profile()])
    first, last = with_step.pipeline.stages
    assert first.step_time_s(3) == pytest.approx(step.time_s(3)) and last.step_time_s(3) == 0.0
    config = SimConfig(SimSchedulerConfig(max_num_seqs=4), max_in_flight=1)
    one = [Request(0, 0.0, 16, 5)]
    slow = compute_metrics(simulate(with_step.pipeline, one, config))
    fast = compute_metrics(simulate(without.pipeline, one, config))
    # one request, one batch at a time: every one of its 5 steps pays the overhead of one sequence
    assert slow.tpot_s.mean - fast.tpot_s.mean == pytest.approx(step.time_s(1), rel=1e-9)
    assert math.isclose(slow.ttft_s.mean - fast.ttft_s.mean, step.time_s(1), rel_tol=1e-9)


def test_transports_follow_the_runtime_rule(monkeypatch) -> None:
    import torch

    assert transports_for("cpu") == ("host",)
    for gpus, profiled in ((1, ("host",)), (2, ("host", "nccl"))):  # NCCL needs a second GPU to time
        monkeypatch.setattr(torch.cuda, "device_count", lambda gpus=gpus: gpus)
        assert transports_for("cuda") == profiled
    link = LinkSpec(1e9)
    cpu, gpu0, gpu1 = (StageSpec(d, t, 0, 1, link) for d, t in
                       (("n/gpu0", "cpu"), ("n/gpu0", "A100-80G"), ("n/gpu1", "A100-80G")))  # fmt: skip
    assert hop_transport(gpu0, gpu1) == "nccl"
    assert hop_transport(gpu0, gpu0) == "host" and hop_transport(cpu, gpu1) == "host"


def test_planner_prices_shared_cores_and_the_profiled_hop(tmp_path) -> None:
    from tessel.plan.build import build_instance

    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "name: local\nnodes:\n"
        "  - {name: host, gpus: {type: cpu, count: 2}, intra_link: {bandwidth_gbps: 80, latency_us: 50}}\n"
        "  - {name: host-slow, gpus: {type: cpu, count: 1}, emulate: {speed: 0.5}}\n"
        "network: {bandwidth_gbps: 80, latency_us: 50}\n"
    )
    hop = _fit(3e-4, 1e-9, "bytes")
    shared = _profile(**{"transport:host": hop})
    apart = replace(shared, cpu_cores=None, components={})
    options = {"dtype": "fp32", "kv_dtype": "fp32"}
    a = build_instance("llama-2-7b", cluster, "default", profiles=[shared], **options)
    b = build_instance("llama-2-7b", cluster, "default", profiles=[apart], **options)
    np.testing.assert_allclose(a.decode.unit_time_s, 1.5 * b.decode.unit_time_s)  # 3 stages, 2 cores
    np.testing.assert_allclose(a.prefill.last_time_s, 1.5 * b.prefill.last_time_s)
    # the emulated node runs on the same host: its hop is the profiled message, not the network link
    n_bytes = (b.decode.send_s[0, 2] - 50e-6) * 10e9  # without the transport fit: the link's 80 Gbit/s
    assert n_bytes > 0 and a.decode.send_s[0, 2] == pytest.approx(hop.time_s(n_bytes))


def test_planner_refuses_a_profile_of_a_device_the_cluster_lacks() -> None:
    from tessel.plan.build import build_instance

    with pytest.raises(TesselError, match=r"device type .cpu. not in cluster a100-8x80g \(A100-80G\)"):
        build_instance("llama-2-7b", "a100-8x80g", "default", profiles=[_profile()])
