"""The plan file contract (`tessel.plan.files.plan_file`): round trip, version-1 files, every refusal."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessel.catalog.gpus import get_gpu
from tessel.catalog.models import load_model
from tessel.errors import TesselError
from tessel.plan.files.cluster import load_cluster, parse_cluster
from tessel.plan.files.plan_file import PLAN_VERSION, SUPPORTED_VERSIONS, PlanFile, load_plan, parse_plan
from tessel.plan.files.plan_parts import gpu_index, unit_kind
from tessel.units import GBPS

FIXTURES = Path(__file__).parent / "fixtures"
V1_LAYER = FIXTURES / "plan_v1_llama2_7b.json"  # `tessel plan --model llama-2-7b --cluster llmpq-t4-v100
V1_SUBLAYER = FIXTURES / "plan_v1_sublayer.json"  # --solver dp [--granularity sublayer] --json`, version 1


def _document(path: Path = V1_LAYER) -> dict:
    return json.loads(path.read_text())


def _write(tmp_path: Path, document, name: str = "plan.json") -> Path:
    path = tmp_path / name
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return path


# ---- version-1 files and derived facts ----------------------------------------------------------


def test_version_1_files_from_tessel_plan_load() -> None:
    plan = load_plan(V1_LAYER)
    raw = _document()
    assert raw["version"] == 1 and plan.version == 5 == PLAN_VERSION  # version 1 reads as the current one
    assert {1, 2, 3} <= SUPPORTED_VERSIONS and not plan.replicas and plan.stages[0].precisions is None
    assert [s.device for s in plan.stages] == [s["device"] for s in raw["stages"]]
    assert plan.num_layers == 32 == plan.model_spec.num_layers and plan.units_per_layer == 1
    assert plan.model_spec is plan.model_spec  # parsed once
    assert plan.model_spec == load_model("llama-2-7b")
    first = raw["stages"][0]
    assert plan.stages[0].link_bytes_per_s == first["link_to_next"]["bandwidth_gbps"] * 1e9 / 8
    assert plan.stages[0].link_latency_s == pytest.approx(first["link_to_next"]["latency_us"] * 1e-6)
    assert plan.stages[-1].link_bytes_per_s is None and plan.stages[-1].emulate_speed == 1.0
    for layer in range(plan.num_layers):
        stage = plan.stage_of_layer(layer)
        assert stage.layer_start <= layer < stage.layer_end
    with pytest.raises(TesselError, match="layer 32 is not in the plan"):
        plan.stage_of_layer(32)
    feasible = {name for name, b in raw["baselines"].items() if b["feasible"] and b["stages"]}
    assert {v.name for v in plan.baseline_variants} == feasible
    assert set(plan.infeasible) == set(raw["baselines"]) - feasible
    assert plan.variants[0].name == "plan" and plan.main.predicted == raw["predicted"]
    plan.check_cluster(load_cluster("llmpq-t4-v100"))
    plan.check_named_cluster()
    plan.check_model("llama-2-7b", 32)


def test_sublayer_plan_units_and_layers() -> None:
    plan = load_plan(V1_SUBLAYER)
    assert plan.granularity == "sublayer" and plan.units_per_layer == 2 and plan.num_units == 64
    assert [unit_kind(u, "sublayer") for u in range(4)] == ["attention", "mlp", "attention", "mlp"]
    assert plan.unit_kind(7) == "mlp" and unit_kind(7, "layer") == "layer"
    for layer in range(32):
        stage = plan.stage_of_layer(layer)
        assert stage.unit_start <= 2 * layer < stage.unit_end


def test_round_trip(tmp_path: Path) -> None:
    for fixture in (V1_LAYER, V1_SUBLAYER):
        plan = load_plan(fixture)
        path = tmp_path / "again.json"
        plan.write(path)
        again = load_plan(path)
        assert again.model_dump() == plan.model_dump() and again.dump() == plan.dump()
        assert json.loads(plan.dump())["stages"][0]["device"] == _document(fixture)["stages"][0]["device"]
    with pytest.raises(TesselError, match="cannot write"):
        plan.write(tmp_path)  # a directory


def test_check_model_and_cluster_say_what_differs() -> None:
    plan = load_plan(V1_LAYER)
    with pytest.raises(TesselError, match=r"model 'llama-2-13b', the plan is for 'llama-2-7b'"):
        plan.check_model("llama-2-13b", 32)
    with pytest.raises(TesselError, match="40 layers, the plan covers 32"):
        plan.check_model("llama-2-7b", 40)
    with pytest.raises(TesselError, match="is not in cluster mixed-a100-v100-t4"):
        plan.check_cluster(load_cluster("mixed-a100-v100-t4"))
    swapped = {
        "name": "llmpq-t4-v100",
        "nodes": [
            {"name": "t4-node", "gpus": {"type": "V100-32G", "count": 4}},
            {"name": "v100-node", "gpus": {"type": "V100-32G", "count": 2}},
        ],
        "network": {"bandwidth_gbps": 10, "latency_us": 5},
    }
    with pytest.raises(TesselError, match="is a T4 in the plan but a V100-32G"):
        plan.check_cluster(parse_cluster(swapped))


# ---- refusals ---------------------------------------------------------------------------------


def _mutated(mutate) -> dict:
    document = _document()
    mutate(document)
    return document


def _set(path: tuple, value):
    def mutate(document: dict) -> None:
        target = document
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _pop(path: tuple):
    def mutate(document: dict) -> None:
        target = document
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


def _stage_shift(document: dict) -> None:
    document["stages"][1]["unit_start"] -= 1
    document["stages"][1]["layer_start"] -= 1


BAD_DOCUMENTS = [
    (_set(("version",), 6), "plan version 6 is not supported; this tessel reads version 1, 2, 3, 4, 5"),
    (_set(("version",), "1"), "plan version '1' is not supported"),
    (_set(("version",), True), "plan version True is not supported"),
    (_pop(("version",)), "plan version missing is not supported"),
    (_pop(("stages",)), "'stages' must be a non-empty list"),
    (_set(("stages",), []), "'stages' must be a non-empty list"),
    (_pop(("stages", 2, "layer_end")), "stages[2] lacks 'layer_end'"),
    (_set(("stages", 2, "layer_end"), "ten"), "stages[2].layer_end: Input should be a valid integer"),
    (_set(("stages", 2, "layer_end"), 10**40), "stages[2].layer_end"),
    (_set(("stages", 0, "kv_gib"), -1.0), "stages[0].kv_gib"),
    (_set(("stages", 0, "link_to_next"), {"bandwidth_gbps": 0}), "stages[0].link_to_next.bandwidth_gbps"),
    (_set(("stages", 0, "emulate_speed"), 2.0), "stages[0].emulate_speed"),
    (_pop(("model",)), "lacks 'model'"),
    (_set(("granularity",), "block"), "granularity"),
    (_set(("stages", 1, "unit_end"), _document()["stages"][1]["unit_start"]), "stages[1] holds no units"),
    (_stage_shift, "'stages' is not contiguous: stages[1] starts at unit"),
    (_set(("stages", 1, "unit_start"), 5), "not contiguous"),
    (_set(("stages", 1, "layer_end"), 30), "stages[1]: layers [3, 30) do not match units [3, 7)"),
    (_set(("stages", 2, "device"), "t4-node/gpu0"), "device 't4-node/gpu0' holds two stages"),
    (_set(("baselines", "uniform", "stages", 1, "device"), "t4-node/gpu0"), "baselines.uniform.stages"),
]


@pytest.mark.parametrize(("mutate", "message"), BAD_DOCUMENTS)
def test_broken_plans_are_refused_with_the_field(tmp_path: Path, mutate, message: str) -> None:
    path = _write(tmp_path, _mutated(mutate))
    with pytest.raises(TesselError) as error:
        load_plan(path)
    assert message in str(error.value) and str(path) in str(error.value)


def test_unreadable_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TesselError, match="does not exist"):
        load_plan(tmp_path / "none.json")
    with pytest.raises(TesselError, match="is a directory"):
        load_plan(tmp_path)
    binary = tmp_path / "plan.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    with pytest.raises(TesselError, match="not UTF-8 text at byte 0"):
        load_plan(binary)
    with pytest.raises(TesselError, match=r"not valid JSON \(line 3: "):
        load_plan(_write(tmp_path, '{\n  "version": 1,\n  "stages": [,]\n}'))
    with pytest.raises(TesselError, match="holds a JSON object, not list"):
        load_plan(_write(tmp_path, "[1, 2]"))
    with pytest.raises(TesselError, match="nested too deeply"):
        load_plan(_write(tmp_path, "[" * 100_000 + "]" * 100_000))
    nan = _document()
    nan["stages"][0]["weights_gib"] = math.nan
    with pytest.raises(TesselError, match=r"stages\[0\].weights_gib"):
        load_plan(_write(tmp_path, json.dumps(nan)))  # json writes NaN; the contract refuses it


# ---- emulate ----------------------------------------------------------------------------------


def test_emulated_devices_plan_slower(tmp_path: Path) -> None:
    cluster = load_cluster(Path(__file__).parents[2] / "examples/clusters/local-cpu-uneven.yaml")
    slow = [d for d in cluster.devices if d.emulate_speed != 1.0]
    assert [d.emulate_speed for d in slow] == [0.5] and len(cluster.devices) == 3
    cpu = get_gpu("cpu")
    for device in cluster.devices:
        assert device.gpu_type == "cpu"
        speed = device.emulate_speed
        assert device.spec.mem_bandwidth_bytes_per_s == pytest.approx(speed * cpu.mem_bandwidth_bytes_per_s)
        assert device.spec.peak_flops("fp32") == pytest.approx(speed * cpu.peak_flops("fp32"))
        assert device.spec.memory_bytes == cpu.memory_bytes
    for speed in (0, 1.5, -1, "fast"):
        data = {"name": "c", "nodes": [{"name": "n", "gpus": {"type": "cpu"}, "emulate": {"speed": speed}}]}
        with pytest.raises(TesselError, match="speed"):
            parse_cluster(data)


def test_plan_records_emulate_speed(tmp_path: Path, smollm2_dir) -> None:
    cluster = Path(__file__).parents[2] / "examples/clusters/local-cpu-uneven.yaml"
    out = tmp_path / "plan.json"
    result = _run_cli(
        "plan", "--cluster", str(cluster), "--model", str(smollm2_dir), "--solver", "dp", "--json", str(out)
    )
    assert result.returncode == 0, result.stderr
    plan = load_plan(out)
    speeds = {s.device: s.emulate_speed for s in plan.stages}
    assert speeds.get("localhost-slow/gpu0") == 0.5
    assert all(speed == 1.0 for device, speed in speeds.items() if device != "localhost-slow/gpu0")
    slow = next(s for s in plan.stages if s.emulate_speed == 0.5)
    fast = [s for s in plan.stages if s.emulate_speed == 1.0]
    assert all(slow.layer_end - slow.layer_start <= s.layer_end - s.layer_start for s in fast)


# ---- the commands refuse bad plans -------------------------------------------------------------


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tessel.cli", *args], capture_output=True, text=True, timeout=300
    )


def _bad_plans(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    foreign = _document()
    foreign["stages"][1]["device"] = "t4-node/gpu9"
    twice = _document()
    twice["stages"][2]["device"] = "t4-node/gpu0"
    future = _document()
    future["version"] = 6
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    return {
        "foreign": (
            _write(tmp_path, foreign, "foreign.json"),
            "'t4-node/gpu9' is not in cluster llmpq-t4-v100",
        ),
        "twice": (_write(tmp_path, twice, "twice.json"), "holds two stages"),
        "future": (_write(tmp_path, future, "future.json"), "plan version 6 is not supported"),
        "binary": (binary, "not UTF-8"),
        "directory": (tmp_path, "is a directory"),
    }


@pytest.mark.parametrize("kind", ["foreign", "twice", "future", "binary", "directory"])
def test_commands_refuse_bad_plans(tmp_path: Path, kind: str) -> None:
    path, message = _bad_plans(tmp_path)[kind]
    commands = [
        ("simulate", "--plan", str(path), "--requests", "2"),
        ("chunk", "--plan", str(path), "--seq-len", "1024"),
    ]
    if kind in ("future", "binary"):  # the re-planner gets the cluster from --cluster
        commands.append(
            (
                "plan",
                "--model",
                "llama-2-7b",
                "--cluster",
                "llmpq-t4-v100",
                "--solver",
                "dp",
                "--replan-from",
                str(path),
            )
        )
    for command in commands:
        result = _run_cli(*command)
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr
        assert message in " ".join(result.stderr.replace("│", " ").split()), (command, result.stderr)


def test_replan_from_a_plan_for_another_cluster_is_refused(tmp_path: Path) -> None:
    path, _ = _bad_plans(tmp_path)["foreign"]
    args = ("plan", "--model", "llama-2-7b", "--cluster", "llmpq-t4-v100", "--solver", "dp")
    result = _run_cli(*args, "--replan-from", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "'t4-node/gpu9' is not in cluster llmpq-t4-v100" in " ".join(result.stderr.split())


# ---- fuzz -------------------------------------------------------------------------------------


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


HOSTILE = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([10**400, -1, 0, 2**31, 2**63, math.nan, math.inf, -math.inf, 1e308, -0.0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
    st.text(max_size=20),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=3),
    st.recursive(st.none(), lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(), inner)),
    st.integers(min_value=1, max_value=900).map(_nested),
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=30,
)


def _paths(value, prefix=()) -> list[tuple]:
    paths = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            paths += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            paths += _paths(item, (*prefix, index))
    return paths


SMALL = _document()
SMALL["baselines"] = {name: b for name, b in list(SMALL["baselines"].items())[:2]}
SMALL_PATHS = _paths(SMALL)
FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _load_or_refuse(path: Path) -> None:
    try:
        plan = load_plan(path)
    except TesselError as error:
        assert str(error)
        str(error).encode("utf-8")  # printable: no lone surrogates in the message
        return
    assert isinstance(plan, PlanFile)
    assert parse_plan(json.loads(plan.dump())).dump() == plan.dump()  # what loads, writes back the same


@FUZZ
@given(st.binary(max_size=400))
def test_fuzz_bytes(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "fuzz.json"
    path.write_bytes(data)
    _load_or_refuse(path)


@FUZZ
@given(JSON)
def test_fuzz_json(tmp_path: Path, document) -> None:
    _load_or_refuse(_write(tmp_path, json.dumps(document), "fuzz.json"))


@FUZZ
@given(st.sampled_from(SMALL_PATHS), HOSTILE, st.booleans())
def test_fuzz_one_field_of_a_valid_plan(tmp_path: Path, path: tuple, value, delete: bool) -> None:
    try:
        text = json.dumps(mutated(SMALL, path, value, delete))
    except (ValueError, RecursionError):  # a value json cannot write
        return
    _load_or_refuse(_write(tmp_path, text, "fuzz.json"))


def mutated(document: dict, path: tuple, value, delete: bool) -> dict:
    """A deep copy of `document` with the field at `path` deleted or set to `value`."""
    document = copy.deepcopy(document)
    target = document
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return document


def test_gbps_is_bits() -> None:
    assert GBPS * 8 == 1e9


def test_gpu_index_reads_a_devices_gpu() -> None:
    """`<node>/gpu<K>` names GPU K of its node; `<node>/gpu<K>#2`, the second name of one GPU two
    stages share, names the same GPU; a name with no number after the node names none."""
    assert gpu_index("node-a/gpu0") == 0 and gpu_index("node-a/gpu13") == 13
    assert gpu_index("box7/gpu3#2") == 3
    assert gpu_index("a100-box/cuda:1") == 1
    assert gpu_index("localhost/cpu") is None and gpu_index("gpu2") is None
