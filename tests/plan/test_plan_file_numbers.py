"""Numbers in a plan file that make no sense are refused on load (issue 27): an emulated speed
below `MIN_EMULATE_SPEED` (a stage that would sleep for ever), more micro-batches in flight than
the planner accepts, a torch device of another kind than the stage's gpu_type; and re-planning from
a plan for another model. A fuzzer over every numeric field: a plan loads with sane numbers or is
refused with a TesselError, never another exception.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tessel.cli import app
from tessel.errors import TesselError
from tessel.plan.files.cluster import parse_cluster
from tessel.plan.files.plan_file import PlanFile, load_plan, parse_plan
from tessel.plan.files.plan_parts import MIN_EMULATE_SPEED
from tessel.plan.files.workload import MAX_MICRO_BATCHES

FIXTURES = Path(__file__).parent / "fixtures"
V1_LAYER = FIXTURES / "plan_v1_llama2_7b.json"  # llama-2-7b on llmpq-t4-v100, 32 layers


def _document() -> dict:
    return json.loads(V1_LAYER.read_text())


def _refusal(document: dict) -> str:
    with pytest.raises(TesselError) as error:
        parse_plan(document, source="p.json")
    return str(error.value)


def _edited(edit) -> dict:
    document = _document()
    edit(document)
    return document


# ---- emulated speed ---------------------------------------------------------------------------


@pytest.mark.parametrize("speed", [1e-9, 5e-324, 0.0099])
def test_an_emulated_speed_below_the_floor_is_refused_naming_stage_and_field(speed: float) -> None:
    message = _refusal(_edited(lambda d: d["stages"][2].update(emulate_speed=speed)))
    assert message.startswith("p.json: ") and "stages[2].emulate_speed" in message
    assert f"below the slowest emulated speed {MIN_EMULATE_SPEED:g}" in message and "100x slower" in message


def test_the_floor_itself_loads() -> None:
    plan = parse_plan(_edited(lambda d: d["stages"][2].update(emulate_speed=MIN_EMULATE_SPEED)))
    assert plan.stages[2].emulate_speed == MIN_EMULATE_SPEED == 0.01


def test_the_runtime_refuses_a_near_zero_speed_before_any_process(tmp_path: Path) -> None:
    """The pipeline runtime reads plans through `load_plan`: the 1e-9 stage of the finding (it ran
    for ever) is refused when the run plan is read."""
    from pipeline_plans import write_plan
    from tessel.pipeline.run_plan import load_run_plan

    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    path = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 4)], speeds=[1.0, 1e-9])
    with pytest.raises(TesselError, match=r"stages\[1\]\.emulate_speed: 1e-09 is below"):
        load_run_plan(path)
    assert (
        load_run_plan(write_plan(path, model, [(0, 2), (2, 4)], speeds=[1.0, 0.25])).stages[1].emulate_speed
        == 0.25
    )


def test_a_cluster_cannot_emulate_below_the_floor() -> None:
    """The planner writes the node's speed into the plan: it refuses what the plan reader would."""
    node = {"name": "n", "gpus": {"type": "cpu", "count": 1}, "emulate": {"speed": 1e-9}}
    with pytest.raises(TesselError, match=r"nodes\[0\]\.emulate\.speed"):
        parse_cluster({"name": "slow", "nodes": [node]})
    node["emulate"]["speed"] = MIN_EMULATE_SPEED
    assert parse_cluster({"name": "slow", "nodes": [node]}).devices[0].emulate_speed == MIN_EMULATE_SPEED


# ---- micro-batches in flight ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [("m", 1_000_000), ("m", MAX_MICRO_BATCHES + 1), ("m", 0), ("m", 2.5), ("m", "8"), ("m", True)]
    + [("max_micro_batch", 10**9), ("max_micro_batch", -1)],
)
def test_micro_batches_beyond_the_planners_cap_are_refused(key: str, value) -> None:
    message = _refusal(_edited(lambda d: d["workload"].update({key: value})))
    assert f"workload.{key} is {value!r}" in message and f"from 1 to {MAX_MICRO_BATCHES}" in message


def test_the_cap_is_what_a_workload_file_accepts() -> None:
    from tessel.plan.files.workload import Workload

    workload = {"name": "w", "prompt_tokens": 8, "output_tokens": 8, "batch_size": 4096}
    assert Workload.model_validate({**workload, "max_micro_batch": MAX_MICRO_BATCHES}).micro_batches == 1024
    with pytest.raises(ValueError, match="max_micro_batch"):
        Workload.model_validate({**workload, "max_micro_batch": MAX_MICRO_BATCHES + 1})
    plan = parse_plan(_edited(lambda d: d["workload"].update(m=MAX_MICRO_BATCHES, max_micro_batch=1024)))
    assert plan.workload["m"] == MAX_MICRO_BATCHES
    assert parse_plan(_edited(lambda d: d["workload"].pop("m"))).workload.get("m") is None


# ---- device kind against gpu_type -------------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "gpu_type", "kind"),
    [("cuda:0", "cpu", "cuda"), ("cuda", "CPU", "cuda"), ("node/cuda:1", "cpu", "cuda"), ("cpu", "T4", "cpu")]
    + [("cpu:3", "A100-80G", "cpu"), ("mps", "cpu", "mps")],
)
def test_a_torch_device_of_another_kind_than_gpu_type_is_refused(
    device: str, gpu_type: str, kind: str
) -> None:
    message = _refusal(_edited(lambda d: d["stages"][1].update(device=device, gpu_type=gpu_type)))
    assert f"stages[1]: device {device!r} is a {kind} device but its gpu_type is {gpu_type!r}" in message


@pytest.mark.parametrize(
    ("device", "gpu_type"),
    [("cuda:0", "T4"), ("cpu", "cpu"), ("cpu:1", "CPU"), ("localhost/gpu0", "cpu"), ("t4-node/gpu9", "T4")]
    + [("localhost/cpu1", "cpu"), ("cudafy", "cpu")],
)
def test_names_that_agree_or_are_not_torch_devices_load(device: str, gpu_type: str) -> None:
    """Cluster names ("localhost/gpu0" for a cpu device) say nothing about the kind: only a torch
    device string is checked."""
    plan = parse_plan(_edited(lambda d: d["stages"][1].update(device=device, gpu_type=gpu_type)))
    assert plan.stages[1].device == device


# ---- re-planning from another model's plan ----------------------------------------------------


def test_replan_from_a_plan_for_another_model_exits_2_naming_both() -> None:
    """llama-3-8b has llama-2-7b's 32 layers, so the old plan's stages fit it; before the check a
    llama-2-7b plan was priced as if its weights were llama-3-8b's."""
    args = [
        "plan",
        "--model",
        "llama-3-8b",
        "--cluster",
        "llmpq-t4-v100",
        "--solver",
        "dp",
        "--time-limit",
        "5",
    ]
    result = CliRunner().invoke(app, [*args, "--replan-from", str(V1_LAYER)])
    assert isinstance(result.exception, TesselError), result.output
    assert result.exception.exit_code == 2  # the CLI prints it on one line and exits 2
    message = " ".join(str(result.exception).split())
    assert "is a plan for model 'llama-2-7b', not 'llama-3-8b'" in message
    assert "vocab_size 32000 vs 128256" in message and "without --replan-from" in message


def test_check_same_model_accepts_the_plans_own_model() -> None:
    from tessel.catalog.models import load_model
    from tessel.plan.remap.replan import check_same_model

    plan = load_plan(V1_LAYER)
    check_same_model(plan, load_model("llama-2-7b"))
    renamed = parse_plan(_edited(lambda d: d["model"].update(name="my-llama")), source="renamed.json")
    with pytest.raises(TesselError, match="'my-llama', not 'llama-2-7b'"):
        check_same_model(renamed, load_model("llama-2-7b"))


# ---- fuzz: every numeric field ----------------------------------------------------------------


def _v2_document() -> dict:
    """The fixture as a version-2 plan with one replica holding a share of m."""
    document = _document()
    document["version"] = 2
    document["replicas"] = [
        {"index": 0, "weight": 1.0, "stages": copy.deepcopy(document["stages"]), "micro_batches": 4}
    ]
    return document


V2 = _v2_document()
STAGE_NUMBERS = [
    "index", "layer_start", "layer_end", "unit_start", "unit_end", "weights_gib", "kv_gib",
    "offload_gib", "prefill_ms", "decode_ms", "emulate_speed",
]  # fmt: skip
NUMERIC_PATHS = (
    [("stages", s, field) for s in (0, 1, len(V2["stages"]) - 1) for field in STAGE_NUMBERS]
    + [("replicas", 0, "stages", 1, field) for field in STAGE_NUMBERS]
    + [("stages", 0, "link_to_next", "bandwidth_gbps"), ("stages", 0, "link_to_next", "latency_us")]
    + [("workload", key) for key in ("m", "max_micro_batch", "micro_batch_size", "alpha_f")]
    + [("replicas", 0, "micro_batches"), ("replicas", 0, "weight"), ("replicas", 0, "index")]
    + [("objective",), ("predicted", "ttft_s"), ("version",)]
)
NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-2, max_value=2 * MAX_MICRO_BATCHES),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=0, max_value=1, allow_subnormal=True),
    st.sampled_from([1e-9, 5e-324, 0.0099, 0.01, 1e308, -0.0, 0, 1, 10**6, 2**31, 2**63, True, False]),
)


def _sane(plan: PlanFile) -> None:
    """What a plan that loads promises its runtime."""
    stages = [*plan.stages, *(s for r in plan.replicas for s in r.stages)]
    assert all(MIN_EMULATE_SPEED <= s.emulate_speed <= 1 for s in stages)
    for key in ("m", "max_micro_batch"):
        value = plan.workload.get(key)
        assert value is None or (type(value) is int and 1 <= value <= MAX_MICRO_BATCHES)
    assert all(r.micro_batches is None or 1 <= r.micro_batches <= MAX_MICRO_BATCHES for r in plan.replicas)
    for s in stages:
        assert 0 <= s.unit_start < s.unit_end and 0 <= s.layer_start < s.layer_end
        for value in (s.weights_gib, s.kv_gib, s.offload_gib, s.prefill_ms, s.decode_ms):
            assert value is None or (math.isfinite(value) and value >= 0)


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(NUMERIC_PATHS), value=NUMBERS)
def test_fuzz_numeric_fields(tmp_path: Path, path: tuple, value) -> None:
    document = copy.deepcopy(V2)
    target = document
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    out = tmp_path / "fuzz.json"
    out.write_text(json.dumps(document))
    try:
        plan = load_plan(out)
    except TesselError as error:
        assert str(out) in str(error)
        str(error).encode("utf-8")
        return
    _sane(plan)
