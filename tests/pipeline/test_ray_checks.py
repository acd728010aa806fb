"""What the Ray executor refuses before any actor starts, without a Ray cluster: a node the cluster
lacks (named, with the nodes present), a GPU a node does not have, stage 0 away from the command, a
replica whose first machine is missing; Ray not installed; the command's threads for its processes."""

from __future__ import annotations

import json
import sys

import pytest

from pipeline_plans import write_plan
from tessel.errors import TesselError
from tessel.pipeline.ray_replicas import replica_nodes
from tessel.pipeline.run_plan import load_run_plan
from tessel.pipeline.supervision.ray_stages import RayNode, check_placement, import_ray, with_command_threads
from tessel.server.replica_backends import ReplicaSpec

NODES = {name: RayNode(name, f"id-{name}", f"10.0.0.{i}", gpus) for i, (name, gpus) in
         enumerate([("head", 0.0), ("h1", 2.0), ("h2", 0.0)])}  # fmt: skip


def _plan(tmp_path, model, devices: list[str], gpu_type: str = "cpu"):
    path = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)], devices=devices)
    if gpu_type != "cpu":
        data = json.loads(path.read_text())
        data["stages"][1]["gpu_type"] = gpu_type
        path.write_text(json.dumps(data))
    return load_run_plan(path)


def test_a_plan_on_present_nodes_passes(tiny_dirs, tmp_path):
    check_placement(_plan(tmp_path, tiny_dirs["tied"], ["head/cpu0", "h1/cpu0"]), NODES, NODES["head"])


def test_a_missing_node_is_named_with_the_nodes_present(tiny_dirs, tmp_path):
    plan = _plan(tmp_path, tiny_dirs["tied"], ["head/cpu0", "h9/cpu0"])
    with pytest.raises(TesselError, match=r"stage 1 on node 'h9'.*lacks; its nodes: h1, h2, head"):
        check_placement(plan, NODES, NODES["head"])


def test_stage_0_away_from_the_command_is_refused(tiny_dirs, tmp_path):
    plan = _plan(tmp_path, tiny_dirs["tied"], ["h1/cpu0", "head/cpu0"])
    with pytest.raises(TesselError, match="run the command on h1"):
        check_placement(plan, NODES, NODES["head"])


def test_a_gpu_the_node_lacks_is_refused(tiny_dirs, tmp_path):
    ok = _plan(tmp_path, tiny_dirs["tied"], ["head/cpu0", "h1/gpu1"], gpu_type="A100-80G")
    check_placement(ok, NODES, NODES["head"])  # h1 has 2 GPUs: gpu1 is its second
    plan = _plan(tmp_path, tiny_dirs["tied"], ["head/cpu0", "h1/gpu2"], gpu_type="A100-80G")
    with pytest.raises(TesselError, match="stage 1 runs on h1/gpu2 .*Ray reports 2 GPUs on node h1"):
        check_placement(plan, NODES, NODES["head"])


def test_a_replica_whose_first_machine_is_missing_is_refused(tiny_dirs, tmp_path):
    path = write_plan(
        tmp_path / "plan.json", tiny_dirs["tied"], [(0, 2), (2, 5)], devices=["head/cpu0", "h1/cpu0"]
    )
    data = json.loads(path.read_text())
    solo = {**data["stages"][1], "index": 0, "device": "h7/cpu0", "layer_start": 0, "unit_start": 0}
    data.update(version=2, replicas=[
        {"index": 0, "weight": 0.5, "stages": data["stages"]},
        {"index": 1, "weight": 0.5, "stages": [solo], "micro_batches": 1},
    ])  # fmt: skip
    path.write_text(json.dumps(data))
    specs = [ReplicaSpec(0, 0.5), ReplicaSpec(1, 0.5)]
    with pytest.raises(TesselError, match=r"replica 1 starts on node 'h7'.*its nodes: h1, h2, head"):
        replica_nodes(path, specs, NODES)
    assert replica_nodes(path, specs[:1], NODES) == {0: NODES["head"]}


def test_ray_not_installed_names_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(TesselError, match=r'pip install "tessel\[cluster\]" \(ray==2.60.0\)'):
        import_ray()


def test_processes_an_actor_starts_get_the_commands_threads():
    ray_actor_env = {"OMP_NUM_THREADS": "1", "PATH": "/bin"}  # what Ray sets in an actor with no CPU
    assert with_command_threads(ray_actor_env, "8") == {"OMP_NUM_THREADS": "8", "PATH": "/bin"}
    assert with_command_threads(ray_actor_env, None) == {"PATH": "/bin"}
    assert ray_actor_env["OMP_NUM_THREADS"] == "1"  # a copy


def test_a_ray_launch_runs_stage_0_on_the_threads_asked_and_gives_them_back(tiny_dirs, tmp_path, monkeypatch):
    # stage 0 of `launch --executor ray` is the command's own process: torch's default (every core)
    # spun OpenMP threads against the other stages (0.66x of local processes, benchmarks/ray_hosts.py)
    import torch

    from tessel.pipeline import ray_executor
    from tessel.pipeline.options import RunOptions
    from tessel.pipeline.run import run_on_ray

    seen = []

    def spawn(options, run_dir):  # noqa: ANN001, ARG001 - stands in for the cluster
        seen.append(counts[-1])
        raise TesselError("no cluster here")

    monkeypatch.setattr(ray_executor.RayExecutor, "spawn", staticmethod(spawn))
    plan = write_plan(
        tmp_path / "plan.json", tiny_dirs["tied"], [(0, 2), (2, 5)], devices=["head/cpu0", "h1/cpu0"]
    )
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # the command's count, whatever the cores
    monkeypatch.setattr(torch, "set_num_threads", lambda n: counts.append(n))
    counts: list[int] = []
    options = RunOptions(plan=plan, model=tiny_dirs["tied"], prompts=["hi"], threads=1, executor="ray")
    with pytest.raises(TesselError, match="no cluster here"):
        run_on_ray(options)
    assert seen == [1]
    assert counts == [1, 3]
