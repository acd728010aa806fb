"""A profile given to plan, simulate, chunk or launch is checked against the run: another device
type, model shape or tessel version is refused naming each field, or used with a printed warning
under --force-profile; a truncated or non-finite profile file is refused naming where. And CPU
stages sharing one host's cores are priced as sharing them at every precision of a mixed plan."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from sim.sim_plans import TINY_LLAMA, write_plan
from tessel import __version__
from tessel.catalog.models import load_model, model_from_config
from tessel.cli import app
from tessel.cost.layer import profile_shape
from tessel.cost.profile import (
    MAX_TERM_S,
    VERSION_KEY,
    ComponentFit,
    DecodeFit,
    PrefillFit,
    Profile,
    load_profile,
)
from tessel.cost.profile_check import check_profile, checked_profiles, scaled_shape
from tessel.errors import TesselError

TINY = model_from_config(TINY_LLAMA, name="tiny-llama", source="test")  # h=1024, f=2816, 16/4 heads
PLAN_TYPES = ("A100-80G", "T4")  # the device types of sim_plans.write_plan


def _profile(device: str = "T4", shape: dict | None = None, **fields) -> Profile:
    return Profile(
        device_type=device,
        model_shape=dict(shape or profile_shape(TINY)),
        dtype=fields.pop("dtype", "fp16"),
        prefill=PrefillFit(1e-3, 1e-5, 1e-8, 1e-10),
        decode=DecodeFit(2e-3, 1e-4, 1e-8),
        heldout_rel_error=0.02,
        **fields,
    )


def _save(profile: Profile, path: Path) -> Path:
    profile.save(path)
    return path


def test_a_profile_of_the_run_has_no_differences() -> None:
    assert check_profile(_profile(), PLAN_TYPES, profile_shape(TINY)) == []
    assert check_profile(_profile("t4 "), PLAN_TYPES, profile_shape(TINY)) == []  # catalog names, any case


def test_each_difference_is_named() -> None:
    shape = profile_shape(TINY) | {"hidden_size": 576, "num_kv_heads": 3}
    meta = {VERSION_KEY: "0.0.7"}
    differences = check_profile(
        _profile("cpu", shape, meta=meta), PLAN_TYPES, profile_shape(TINY), "tiny-llama", "test"
    )
    assert differences == [
        "device type 'cpu' not in cluster test (A100-80G, T4)",
        "model shape hidden_size 576 != 1024, num_kv_heads 3 != 4 (model tiny-llama)",
        f"tessel version 0.0.7 != {__version__} (this tessel)",
    ]
    same_minor = ".".join(__version__.split(".")[:2]) + ".99"  # a patch release reads the same format
    assert check_profile(_profile(meta={VERSION_KEY: same_minor}), PLAN_TYPES, profile_shape(TINY)) == []


def test_a_scaled_profile_of_the_model_matches_it() -> None:
    """`tessel profile --scale 4` times the model's layer / 4: the shape it records is that one."""
    model = load_model("llama-3-8b")  # 32 heads, 8 KV heads, head_dim 128, f = 14336
    scaled = scaled_shape(profile_shape(model), 4)
    assert scaled == {"hidden_size": 1024, "intermediate_size": 3584, "num_heads": 8, "num_kv_heads": 2,
                      "head_dim": 128}  # fmt: skip
    from tessel.profiling.layer import LayerShape  # what `tessel profile --scale` times

    for name in ("llama-3-8b", "qwen2.5-7b", "mistral-7b", "llama-2-70b"):
        shape = profile_shape(load_model(name))
        for factor in (1, 3, 4, 8, 64):
            assert scaled_shape(shape, factor) == LayerShape(**shape).scaled(factor).as_dict(), (name, factor)
    profile = _profile("cpu", scaled, meta={"scale": "4"})
    assert check_profile(profile, ["cpu"], profile_shape(model)) == []
    assert check_profile(replace(profile, meta={"scale": "8"}), ["cpu"], profile_shape(model)) == [
        "model shape hidden_size 1024 != 512, intermediate_size 3584 != 1792, num_heads 8 != 4, "
        "num_kv_heads 2 != 1 (the model's layer / 8, as profiled)"
    ]


def test_refused_naming_the_file_and_each_field_or_used_with_a_warning(tmp_path: Path) -> None:
    good = _save(_profile(), tmp_path / "t4.json")
    bad = _save(_profile("cpu", profile_shape(TINY) | {"hidden_size": 576}), tmp_path / "cpu.json")
    shape = profile_shape(TINY)
    with pytest.raises(TesselError) as refused:
        checked_profiles([good, bad], PLAN_TYPES, shape, model_name="tiny-llama")
    message = str(refused.value)
    assert f"profile {bad}: device type 'cpu' not in the cluster" in message
    assert "model shape hidden_size 576 != 1024 (model tiny-llama)" in message
    assert "--force-profile" in message and str(good) not in message
    warnings: list[str] = []
    loaded = checked_profiles([good, bad], PLAN_TYPES, shape, force=True, warn=warnings.append)
    assert [p.device_type for p in loaded] == ["T4", "cpu"]
    assert len(warnings) == 1 and f"profile {bad} used as forced" in warnings[0]
    assert "hidden_size 576 != 1024" in warnings[0]


def test_the_version_is_written_and_a_file_without_one_is_warned_about(tmp_path: Path) -> None:
    path = _save(_profile(), tmp_path / "p.json")
    assert load_profile(path).meta[VERSION_KEY] == __version__
    recorded = _save(_profile(meta={VERSION_KEY: "0.0.1"}), tmp_path / "old.json")
    assert load_profile(recorded).meta[VERSION_KEY] == "0.0.1"  # what wrote the fit, not a re-save
    data = json.loads(path.read_text())
    del data["meta"][VERSION_KEY]
    path.write_text(json.dumps(data))
    warnings: list[str] = []
    checked_profiles([path], PLAN_TYPES, profile_shape(TINY), warn=warnings.append)
    assert warnings == [f"profile {path} records no tessel version (an older tessel wrote it); profile again"]
    with pytest.raises(TesselError, match=r"old\.json: tessel version 0\.0\.1 != "):
        checked_profiles([recorded], PLAN_TYPES, profile_shape(TINY))


def test_a_profile_timed_before_passes_of_several_prompts_is_warned_about(tmp_path: Path) -> None:
    step = ComponentFit(4e-4, 3e-5, "sequences", 0.01, 12)
    older = _save(_profile(components={"step": step}), tmp_path / "older.json")
    warnings: list[str] = []
    checked_profiles([older], PLAN_TYPES, profile_shape(TINY), warn=warnings.append)
    assert len(warnings) == 1 and f"profile {older} has no prefill_batch fit" in warnings[0]
    batch = ComponentFit(7e-4, 2e-4, "sequences", 0.01, 10, {"chunk_tokens": 32})
    newer = _save(_profile(components={"step": step, "prefill_batch": batch}), tmp_path / "newer.json")
    warnings.clear()
    checked_profiles([newer], PLAN_TYPES, profile_shape(TINY), warn=warnings.append)
    assert warnings == []
    assert load_profile(newer).components["prefill_batch"] == batch


def test_truncated_and_non_finite_files_are_refused_naming_where(tmp_path: Path) -> None:
    profile = _profile(components={"step": ComponentFit(4e-4, 3e-5, "sequences", 0.01, 12)})
    text = json.dumps(profile.to_json(), indent=2)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: len(text) // 2])
    where = r"not valid JSON \(line \d+: .* at column \d+; it ends unclosed at line \d+: truncated\?\)"
    with pytest.raises(TesselError, match=rf"{re.escape(str(cut))}: {where}"):
        load_profile(cut)
    for field, value, where in (
        ('"c0": 0.0004', '"c0": NaN', "components.step.c0"),
        ('"a1": 1e-05', '"a1": Infinity', "prefill.a1"),
        ('"b0": 0.002', '"b0": -1e999', "decode.b0"),
    ):
        broken = tmp_path / "broken.json"
        assert field in text
        broken.write_text(text.replace(field, value))
        finite = f"{re.escape(str(broken))}: {where}: Input should be a finite number"
        with pytest.raises(TesselError, match=finite):
            load_profile(broken)


# Where a fitted time sits in the file, and a value no fit of measured times has there (issue 42: a0 = -1
# and a1 = 1e300 were used without a word, and the plan came out as the real profile's)
COEFFICIENTS = [
    *(("prefill", name) for name in ("a0", "a1", "a2", "a3")),
    *(("decode", name) for name in ("b0", "b1", "b2")),
    *(("components.step", name) for name in ("c0", "c1")),
]


@settings(max_examples=30, deadline=None)
@given(
    where=st.sampled_from(COEFFICIENTS),
    value=st.one_of(
        st.floats(-1e300, -1e-300),  # a time is never negative
        st.floats(MAX_TERM_S, 1e300, exclude_min=True),  # nor longer than any device takes for one unit
    ),
)
def test_implausible_coefficients_are_refused_naming_the_file_and_coefficient(tmp_path_factory, where, value):
    component, name = where
    data = _profile(components={"step": ComponentFit(4e-4, 3e-5, "sequences", 0.01, 12)}).to_json()
    fit = data
    for key in component.split("."):
        fit = fit[key]
    fit[name] = value
    path = tmp_path_factory.mktemp("profiles") / "implausible.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TesselError) as refused:
        load_profile(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: {component}.{name} = {value:g} s"), message
    assert ("negative" if value < 0 else f"above {MAX_TERM_S:g} s") in message and "tessel profile" in message


@pytest.mark.parametrize("knots", [[[1.0, 2e-3], [16.0, -1e-3]], [[1.0, 2e-3], [16.0, 1e300]]])
def test_implausible_knot_times_are_refused(tmp_path: Path, knots: list) -> None:
    data = _profile().to_json()
    data["decode"]["knots"] = knots
    path = tmp_path / "knots.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TesselError, match=rf"{re.escape(str(path))}: decode\.knots\[1\] = "):
        load_profile(path)


def test_the_python_api_refuses_an_implausible_fit() -> None:
    with pytest.raises(TesselError, match="a0 = -1 s"):
        PrefillFit(-1.0, 1e-5, 1e-8, 1e-10)
    with pytest.raises(TesselError, match=f"c1 = 1e\\+300 s per byte: above {MAX_TERM_S:g} s"):
        ComponentFit(1e-4, 1e300, "bytes", 0.01, 12)


# ---- the commands ----------------------------------------------------------------------------


def _run(args: list[str]):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_plan_refuses_another_models_profile_and_forces_it_with_a_warning(tmp_path: Path) -> None:
    smol = {"hidden_size": 576, "intermediate_size": 1536, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64}
    path = _save(_profile("cpu", smol, dtype="fp32", compute_efficiency=0.2), tmp_path / "smol.json")
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    args = ["plan", "--model", tmp_path / "config.json", "--cluster", "local-cpu", "--solver", "dp",
            "--dtype", "fp32", "--kv-dtype", "fp32", "--profile", path]  # fmt: skip
    refused = _run(args)
    assert refused.exit_code != 0 and isinstance(refused.exception, TesselError)
    assert f"profile {path}: model shape hidden_size 576 != 1024" in str(refused.exception)
    forced = _run([*args, "--force-profile"])
    assert forced.exit_code == 0, forced.output
    assert f"warning: profile {path} used as forced, though model shape hidden_size 576" in forced.stderr
    assert "warning" not in forced.stdout


def test_simulate_chunk_and_launch_refuse_another_devices_profile(tmp_path: Path) -> None:
    plan = write_plan(tmp_path)
    path = _save(_profile("V100-32G"), tmp_path / "v100.json")
    expected = f"profile {path}: device type 'V100-32G' not in cluster test (A100-80G, T4)"
    runs = {
        "simulate": ["simulate", "--plan", plan, "--requests", "4", "--profile", path],
        "chunk": ["chunk", "--plan", plan, "--seq-len", "1024", "--grid", "256", "--profile", path],
    }
    for name, args in runs.items():
        refused = _run(args)
        assert isinstance(refused.exception, TesselError) and expected in str(refused.exception), name
        forced = _run([*args, "--force-profile"])
        assert forced.exit_code == 0, (name, forced.output)
        assert f"profile {path} used as forced, though device type 'V100-32G'" in forced.stderr, name
    # launch: refused before any stage starts (here before the missing model is even looked at)
    launch = ["launch", "--plan", plan, "--model", tmp_path / "no-model", "--prompt", "hi", "--profile", path]
    refused = _run(launch)
    assert isinstance(refused.exception, TesselError) and expected in str(refused.exception)
    forced = _run([*launch, "--force-profile"])
    assert f"profile {path} used as forced" in forced.stderr and expected not in str(forced.exception)
    good = _save(_profile(), tmp_path / "t4.json")
    ok = _run(["chunk", "--plan", plan, "--seq-len", "1024", "--grid", "256", "--profile", good])
    assert ok.exit_code == 0 and "warning" not in ok.output


def test_chunk_without_a_plan_checks_against_the_cluster(tmp_path: Path) -> None:
    path = _save(_profile("cpu"), tmp_path / "cpu.json")
    refused = _run(["chunk", "--model", "llama-2-7b", "--cluster", "a100-8x80g", "--stages", "2",
                    "--seq-len", "1024", "--grid", "256", "--profile", path])  # fmt: skip
    message = str(refused.exception)
    assert "device type 'cpu' not in cluster a100-8x80g (A100-80G)" in message
    assert "model shape hidden_size 1024 != 4096" in message


# ---- shared cores at every precision ---------------------------------------------------------


def _two_cpus(tmp_path: Path) -> Path:
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "name: one-host\nnodes:\n"
        "  - {name: host, gpus: {type: cpu, count: 2}, intra_link: {bandwidth_gbps: 80, latency_us: 50}}\n"
        "network: {bandwidth_gbps: 80, latency_us: 50}\n"
    )
    return cluster


def test_mixed_precision_units_are_priced_with_the_hosts_core_share(tmp_path: Path) -> None:
    """Two CPU stages of one thread each on a host of 1 core: every unit at every precision takes
    2x its time alone (as at one precision: `test_planner_prices_shared_cores_and_the_profiled_hop`)."""
    from tessel.plan.build import build_instance

    cluster = _two_cpus(tmp_path)
    options = {"dtype": "fp16", "kv_dtype": "fp16", "precisions": ("fp16", "int8")}
    shared = _profile("cpu", cpu_cores=1, threads=1)
    apart = replace(shared, cpu_cores=None)
    a = build_instance(TINY, cluster, "default", profiles=[shared], **options)
    b = build_instance(TINY, cluster, "default", profiles=[apart], **options)
    assert a.precision is not None and a.precision.names == ("fp16", "int8")
    np.testing.assert_allclose(a.precision.prefill_time_s, 2.0 * b.precision.prefill_time_s, rtol=1e-12)
    np.testing.assert_allclose(a.precision.decode_time_s, 2.0 * b.precision.decode_time_s, rtol=1e-12)
    np.testing.assert_allclose(a.decode.unit_time_s, 2.0 * b.decode.unit_time_s, rtol=1e-12)
    # the host's cores from a profile of another precision when the reference one has none
    int8_only = _profile("cpu", dtype="int8", cpu_cores=1, threads=1)
    c = build_instance(TINY, cluster, "default", profiles=[int8_only], **options)
    d = build_instance(TINY, cluster, "default", profiles=[replace(int8_only, cpu_cores=None)], **options)
    np.testing.assert_allclose(c.precision.prefill_time_s, 2.0 * d.precision.prefill_time_s, rtol=1e-12)


def test_simulator_stages_of_a_mixed_plan_share_the_cores_from_any_precisions_profile() -> None:
    from tessel.chunk.from_plan import StageSpec, build_pipeline
    from tessel.cost.link import LinkSpec

    link = LinkSpec(10e9, 50e-6)
    half = TINY.num_layers // 2
    precisions = tuple(("fp16", "int8")[i % 2] for i in range(half))
    stages = [StageSpec("host/cpu0", "cpu", 0, half, link, node="host", precisions=precisions),
              StageSpec("host/cpu1", "cpu", half, TINY.num_layers, None, node="host",
                        precisions=precisions)]  # fmt: skip
    int8_only = _profile("cpu", dtype="int8", cpu_cores=1, threads=1)
    shared = build_pipeline(TINY, stages, profiles=[int8_only]).pipeline.stages
    alone = build_pipeline(TINY, stages, profiles=[replace(int8_only, cpu_cores=None)]).pipeline.stages
    for s, a in zip(shared, alone, strict=True):
        assert s.prefill_time_s(64, 32) == pytest.approx(2.0 * a.prefill_time_s(64, 32), rel=1e-12)
        assert s.decode_time_s(3, 300) == pytest.approx(2.0 * a.decode_time_s(3, 300), rel=1e-12)


def test_planner_and_simulator_agree_on_a_mixed_plans_shared_cores(tmp_path: Path) -> None:
    """Oracle: the planner's own evaluation of a mixed-precision split over two CPU stages of one
    host (1 core, 1 thread each: share 2) is the simulator's stage time for the same plan file."""
    from tessel.plan.build import build_instance
    from tessel.plan.files.cluster import load_cluster
    from tessel.plan.files.plan_file import parse_plan
    from tessel.plan.files.workload import Workload
    from tessel.plan.report import plan_json
    from tessel.plan.solution import Solution, Stage, evaluate
    from tessel.sim.plan_pipeline import pipeline_for

    cluster = load_cluster(_two_cpus(tmp_path))
    lengths = {"prompt_tokens": {"mean": 96, "max": 192}, "output_tokens": {"mean": 8, "max": 16}}
    workload = Workload(name="w", batch_size=4, **lengths)
    profile = _profile("cpu", cpu_cores=1, threads=1)
    options = {"precisions": ("fp16", "int8"), "theta": 0.0, "profiles": [profile]}
    instance = build_instance(TINY, cluster, workload, **options)
    solution = Solution((Stage(0, 0, 3), Stage(1, 3, 8))).with_precisions([1, 0, 1, 1, 0, 0, 1, 0])
    evaluation = evaluate(instance, solution)
    document = plan_json(instance, evaluation, model=TINY, cluster=cluster, cluster_source=cluster.name,
                         workload=workload, solver={"name": "test"}, baselines={})  # fmt: skip
    plan = parse_plan(json.loads(document.dump()))
    shared = pipeline_for(plan, profiles=[profile]).pipeline.stages
    alone = pipeline_for(plan, profiles=[replace(profile, cpu_cores=None)]).pipeline.stages
    b, context = workload.micro_batch_size, workload.mean_decode_context_tokens
    for stage, apart, expected in zip(shared, alone, evaluation.stages, strict=True):
        assert stage.decode_time_s(b, b * context) == pytest.approx(expected.compute_decode_s, rel=1e-9)
        assert stage.decode_time_s(b, b * context) == pytest.approx(2.0 * apart.decode_time_s(b, b * context))
