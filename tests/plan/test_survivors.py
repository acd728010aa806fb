"""The plan on the surviving stages (`tessel.plan.remap.survivors`), torch-free: the planner's plan on
the cluster without the lost devices when that cluster can be read back, else a split by memory.

Oracles: a brute force over every contiguous split for `split_by_memory`; `make_plan` on a cluster
file that lists only the devices left, for the planner's survivor plan."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import yaml

import tessel.catalog
from pipeline_plans import write_gpu_plan
from tessel.errors import TesselError
from tessel.plan.api import PlanSettings, make_plan
from tessel.plan.files.plan_file import load_plan
from tessel.plan.remap.survivors import SurvivorsTooSmallError, split_by_memory, survivor_plan

BUNDLED_CLUSTERS = Path(tessel.catalog.__file__).parent / "clusters"
SURVIVOR_TIME_LIMIT_S = 60.0  # far above what these small plans take: no solve stops on the clock


def _brute_fits(layer_bytes, usable, first, last) -> bool:
    n, layers = len(usable), len(layer_bytes)
    for cuts in itertools.combinations(range(1, layers), n - 1):
        bounds = [0, *cuts, layers]
        held = [sum(layer_bytes[bounds[k] : bounds[k + 1]]) for k in range(n)]
        held[0] += first
        held[-1] += last
        if all(h <= u for h, u in zip(held, usable, strict=True)):
            return True
    return False


def test_split_by_memory_finds_a_fitting_split_exactly_when_one_exists():
    rng = random.Random(5)
    for _ in range(300):
        layers, n = rng.randint(1, 7), rng.randint(1, 4)
        layer_bytes = [rng.randint(1, 5) for _ in range(layers)]
        usable = [rng.randint(1, 14) for _ in range(n)]
        first, last = rng.randint(0, 3), rng.randint(0, 3)
        split = split_by_memory(layer_bytes, usable, first, last)
        assert (split is not None) == (layers >= n and _brute_fits(layer_bytes, usable, first, last))
        if split is None:
            continue
        assert [a for a, _ in split] == [0, *[b for _, b in split[:-1]]] and split[-1][1] == layers
        held = [sum(layer_bytes[a:b]) for a, b in split]
        held[0] += first
        held[-1] += last
        assert all(b > a for a, b in split) and all(h <= u for h, u in zip(held, usable, strict=True))


def test_split_by_memory_is_proportional_when_that_fits():
    assert split_by_memory([1.0] * 12, [100, 200, 100], 0, 0) == [(0, 3), (3, 9), (9, 12)]


def test_survivor_plan_keeps_the_order_and_splits_by_memory(tmp_path):
    plan = load_plan(write_gpu_plan(tmp_path / "p.json", ["A100-80G", "T4", "A100-80G"], "llama-2-13b", 40))
    survivor = survivor_plan(plan, {1})
    assert [s.device for s in survivor.stages] == ["n/gpu0", "n/gpu2"]
    assert [(s.layer_start, s.layer_end) for s in survivor.stages] == [(0, 20), (20, 40)]
    assert [s.index for s in survivor.stages] == [0, 1]
    assert survivor.stages[0].link_to_next is not None and survivor.stages[-1].link_to_next is None


def test_survivor_plan_refuses_when_the_survivors_cannot_hold_the_model(tmp_path):
    plan = load_plan(write_gpu_plan(tmp_path / "p.json", ["A100-80G", "T4", "T4"], "llama-2-70b", 80))
    with pytest.raises(SurvivorsTooSmallError) as caught:
        survivor_plan(plan, {0})
    message = str(caught.value)
    assert "stage 0 (n/gpu0)" in message and "cannot hold the model" in message and "GiB" in message


def _without_last_gpu(name: str, node: str, path: Path) -> Path:
    """The bundled cluster `name` as a file, `node` holding one GPU fewer: its last one is gone."""
    data = yaml.safe_load((BUNDLED_CLUSTERS / f"{name}.yaml").read_text())
    (group,) = [n for n in data["nodes"] if n["name"] == node]
    group["gpus"]["count"] -= 1
    path.write_text(yaml.safe_dump(data))
    return path


def test_survivor_plan_on_a_bundled_cluster_is_the_planners_without_the_lost_device(tmp_path):
    """A plan made for a bundled cluster loses a stage: the survivors' plan is the planner's (stages,
    figures, objective) on that cluster without the lost device, and names the bundled cluster, so
    the next loss reads it again."""
    # pipeline-only (--max-tp 1): the runtime's stage loss; the survivors re-plan at the plan's degree
    plan = make_plan(
        "llama-2-13b", "llmpq-v100-a100", "default", PlanSettings(solver="dp", max_tp=1)
    ).plan_file()
    lost_device = "a100-node/gpu1"
    (lost,) = [s.index for s in plan.stages if s.device == lost_device]
    survivor = survivor_plan(plan, {lost}, time_limit_s=SURVIVOR_TIME_LIMIT_S)
    settings = PlanSettings(time_limit_s=SURVIVOR_TIME_LIMIT_S, max_tp=1)
    without = _without_last_gpu("llmpq-v100-a100", "a100-node", tmp_path / "three.yaml")
    direct = make_plan("llama-2-13b", without, "default", settings).plan_file()
    assert lost_device not in {s.device for s in survivor.stages}
    assert survivor.solver["status"] != "time limit" and direct.solver["status"] != "time limit"
    assert [s.model_dump() for s in survivor.stages] == [s.model_dump() for s in direct.stages]
    assert survivor.objective == direct.objective and survivor.predicted == direct.predicted
    assert survivor.cluster.source == "llmpq-v100-a100"


def test_survivors_too_small_for_the_planner_end_the_pipeline(tmp_path):
    """The plan's cluster is at hand but the one device left cannot hold the model (no host memory
    to offload into): the planner refuses, and so does `survivor_plan`, with the recovery "none"."""
    cluster = tmp_path / "three-a100.yaml"
    cluster.write_text(
        "name: three-a100\nnodes:\n  - name: box\n    gpus: {type: A100-80G, count: 3}\n"
        "    intra_link: pcie\n    host_memory_gib: 0\n"
    )
    plan = make_plan("llama-2-70b", cluster, "default", PlanSettings(solver="dp", max_tp=1)).plan_file()
    assert len(plan.stages) == 3
    with pytest.raises(SurvivorsTooSmallError) as caught:
        survivor_plan(plan, {1, 2}, time_limit_s=SURVIVOR_TIME_LIMIT_S)
    message = str(caught.value)
    assert "stage 1 (box/gpu1), stage 2 (box/gpu2)" in message and "cannot hold the model" in message
    assert "does not fit" in message  # the planner's refusal, not the split by memory's
    assert isinstance(caught.value, TesselError) and caught.value.recovery == "none"
