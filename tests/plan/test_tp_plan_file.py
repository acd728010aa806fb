"""Plan file version 5: tensor-parallel stages round-trip, older versions read as degree 1, and bad
tensor-parallel stages are refused before anything runs (naming the stage and the numbers)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tessel.errors import TesselError
from tessel.plan.api import PlanSettings, make_plan
from tessel.plan.files.cluster import load_cluster, parse_cluster
from tessel.plan.files.plan_file import PLAN_VERSION, load_plan, parse_plan
from tessel.plan.files.tp_checks import check_tp_stages

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def tp_document() -> dict:
    """A plan of Llama-3-70B on one 8x A100 + one 4x T4 machine for one stream: one TP-8 stage."""
    outcome = make_plan("llama-3-70b", "a100x8-t4x4", "single-stream", PlanSettings(time_limit_s=5))
    return json.loads(outcome.plan_file().dump())


def test_tp_plan_round_trips(tp_document: dict, tmp_path: Path) -> None:
    assert tp_document["version"] == PLAN_VERSION == 5
    stage = tp_document["stages"][0]
    assert stage["tp_degree"] == 8 and stage["gpus"] == [f"dgx/gpu{i}" for i in range(8)]
    assert stage["gpus"][0] == stage["device"] and stage["tp_link"]["bandwidth_gbps"] > 0
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(tp_document))
    plan = load_plan(path)
    assert plan.stages[0].rank_gpus == tuple(stage["gpus"]) and plan.stages[0].tp_degree == 8
    assert json.loads(plan.dump()) == json.loads(parse_plan(tp_document).dump())
    plan.check_cluster(load_cluster("a100x8-t4x4"))  # passes
    # every baseline stage is one GPU, written as such
    for baseline in tp_document["baselines"].values():
        for s in baseline["stages"] or []:
            assert s["tp_degree"] == 1 and s["gpus"] == [s["device"]]


def test_older_versions_read_as_one_gpu_per_stage() -> None:
    plan = load_plan(FIXTURES / "plan_v1_llama2_7b.json")
    assert plan.version == PLAN_VERSION
    assert all(s.tp_degree == 1 and s.rank_gpus == (s.device,) and s.tp_link is None for s in plan.stages)


def _mutated(document: dict, **fields) -> dict:
    changed = copy.deepcopy(document)
    changed["stages"][0].update(fields)
    return changed


def _refusal(document: dict) -> str:
    with pytest.raises(TesselError) as error:
        parse_plan(document, source="bad.json")
    return str(error.value)


def test_degree_that_does_not_divide_heads_is_refused(tp_document: dict) -> None:
    gpus = [f"dgx/gpu{i}" for i in range(8)]
    model = tp_document["model"]["config"]
    bad = _mutated(tp_document, tp_degree=4, gpus=gpus[:4])
    bad["model"]["config"] = {**model, "num_heads": 50, "num_kv_heads": 10}  # 4 divides neither
    message = _refusal(bad)
    assert "stages[0] (dgx/gpu0): degree 4 does not divide the 50 heads of llama-3-70b" in message
    message = _refusal(_mutated(tp_document, tp_degree=3, gpus=gpus[:3]))
    assert "stages[0] (dgx/gpu0): tp_degree 3 is not one of 1, 2, 4, 8" in message


def test_gpus_must_list_one_gpu_per_rank(tp_document: dict) -> None:
    message = _refusal(_mutated(tp_document, gpus=[f"dgx/gpu{i}" for i in range(6)]))
    assert "stages[0] (dgx/gpu0): tp_degree 8 but 6 gpus listed" in message
    message = _refusal(_mutated(tp_document, gpus=[f"dgx/gpu{i}" for i in (1, 0, 2, 3, 4, 5, 6, 7)]))
    assert "gpus[0] is 'dgx/gpu1', not the stage's device" in message


def test_a_gpu_named_twice_is_refused(tp_document: dict) -> None:
    gpus = [f"dgx/gpu{i}" for i in (0, 1, 2, 3, 4, 5, 6, 6)]
    message = _refusal(_mutated(tp_document, gpus=gpus))
    assert (
        "GPU 'dgx/gpu6' is named twice: stages[0] (dgx/gpu0) rank 6 and stages[0] (dgx/gpu0) rank 7"
        in message
    )
    two = copy.deepcopy(tp_document)
    first = two["stages"][0]
    second = {**first, "index": 1, "device": "dgx/gpu4", "gpus": [f"dgx/gpu{i}" for i in (4, 5, 6, 7)]}
    first.update(tp_degree=4, gpus=[f"dgx/gpu{i}" for i in (0, 1, 2, 4)], layer_end=40, unit_end=40)
    first["link_to_next"] = {"bandwidth_gbps": 2400.0, "latency_us": 2.0}
    second.update(tp_degree=4, layer_start=40, unit_start=40)
    two["stages"] = [first, second]
    assert "GPU 'dgx/gpu4' is named twice: stages[0] (dgx/gpu0) rank 3 and stages[1] (dgx/gpu4) rank 0" in (
        _refusal(two)
    )


def test_gpus_on_two_machines_are_refused(tp_document: dict) -> None:
    gpus = [f"dgx/gpu{i}" for i in range(4)] + [f"t4-node/gpu{i}" for i in range(4)]
    message = _refusal(_mutated(tp_document, gpus=gpus))
    assert "stages[0] (dgx/gpu0): its 8 GPUs are on different machines (dgx, t4-node)" in message


def test_cluster_checks_types_and_counts(tp_document: dict) -> None:
    # one machine with 4 A100s and 4 T4s: a stage of 8 mixes types and exceeds the 4 A100s
    mixed = parse_cluster(
        {
            "name": "mixed-node",
            "nodes": [
                {"name": "dgx", "gpus": [{"type": "A100-80G", "count": 4}, {"type": "T4", "count": 4}]}
            ],
        }
    )
    plan = parse_plan(tp_document, source="tp.json")
    with pytest.raises(TesselError) as error:
        check_tp_stages(plan, cluster=mixed)
    message = str(error.value)
    assert "tp.json: stages[0] (dgx/gpu0): its GPUs are of different types (A100-80G, T4)" in message
    assert "tp_degree 8 is above the 4 A100-80G GPUs of machine dgx" in message
    small = parse_cluster(
        {"name": "dgx4", "nodes": [{"name": "dgx", "gpus": {"type": "A100-80G", "count": 4}}]}
    )
    with pytest.raises(TesselError, match=r"dgx/gpu4, dgx/gpu5, dgx/gpu6, dgx/gpu7 not in cluster dgx4"):
        check_tp_stages(plan, cluster=small)


def test_runtime_check_takes_the_model_it_will_load(tp_document: dict) -> None:
    from dataclasses import replace

    plan = parse_plan(tp_document, source="tp.json")
    check_tp_stages(plan)  # the plan's own model: fine
    odd = replace(plan.model_spec, num_heads=24, num_kv_heads=3)
    with pytest.raises(
        TesselError, match=r"stages\[0\] \(dgx/gpu0\): degree 8 does not divide the 3 KV heads"
    ):
        check_tp_stages(plan, model=odd)
