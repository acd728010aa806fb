"""Evicted KV brought back by swap or recompute, chosen per stage: the MILP and the DP against the
brute force (which tries both modes on every stage), the closed-form split against a search over
every split, the bundled T4-on-Gen3 / A100-on-Gen4 cluster, the plan file field and bad input."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from plan.random_instances import random_instance, with_precision_choice
from tessel.errors import TesselError
from tessel.plan.build import build_instance
from tessel.plan.files.cluster import list_bundled_clusters, load_cluster, parse_cluster
from tessel.plan.instance import KvRestore
from tessel.plan.solution import Solution, evaluate, split_offload
from tessel.plan.solvers.bound import counts_search
from tessel.plan.solvers.brute import brute_force
from tessel.plan.solvers.dp import solve_dp
from tessel.plan.solvers.milp import solve_milp
from tessel.plan.solvers.solve import solve
from tessel.units import GBPS, GIB

CLUSTER = "t4-gen3-a100-gen4"


def _with_kv_restore(rng: np.random.Generator, instance):
    """The instance with swap and recompute rates per device type around its weight-streaming rate
    (times m, so a pass's 1/m share straddles it): each mode wins somewhere, KV or weights leave first."""
    types = sorted({d.gpu_type for d in instance.devices})
    per_type = {t: rng.uniform(0.1, 3.0, size=2) for t in types}
    m = instance.micro_batches
    rates = np.array([per_type[d.gpu_type] * m / d.host_to_device_bytes_per_s for d in instance.devices])
    return replace(instance, kv_restore=KvRestore(rates[:, 0], rates[:, 1]))


@pytest.mark.parametrize("seed", range(6))
def test_milp_and_dp_match_brute_force_with_kv_restore(seed):
    rng = np.random.default_rng(1000 + seed)
    kind = ("layer", "sublayer", "precision")[seed % 3]
    granularity = "sublayer" if kind == "sublayer" else "layer"
    n_units = 4 if kind == "precision" else int(rng.integers(4, 7))  # brute force: P^U times the plans
    base = random_instance(rng, n_units, 3, offload=True, tight_memory=True,
                           overlap=bool(seed % 2), granularity=granularity)  # fmt: skip
    if kind == "precision":
        base = with_precision_choice(base, rng, 2, budget=True, theta=bool(seed % 2))
    instance = _with_kv_restore(rng, base)
    brute = brute_force(instance)
    milp = solve_milp(instance, mip_gap=0.0, time_limit_s=30)
    dp = solve_dp(instance) if instance.precision is None else milp  # the DP fixes precisions first
    if brute.solution is None:
        assert milp.solution is None and dp.solution is None
        return
    best = brute.evaluation.objective
    assert milp.evaluation.objective == pytest.approx(best, rel=1e-6)
    assert dp.evaluation.objective == pytest.approx(best, rel=1e-6)
    # the mode evaluate picks on each evicting stage is the one the explicit search found
    chosen = evaluate(instance, brute.solution.with_kv_modes(None))
    assert chosen.objective == pytest.approx(best, rel=1e-12)
    for forced, auto in zip(brute.evaluation.stages, chosen.stages, strict=True):
        if forced.kv_evicted_bytes > 0 and forced.kv_preemption != auto.kv_preemption:
            assert forced.offload_s == pytest.approx(auto.offload_s, rel=1e-12)  # a tie only


@pytest.mark.parametrize("seed", [1])
def test_counts_bound_stays_below_brute_force_with_kv_restore(seed):
    rng = np.random.default_rng(3000 + seed)
    base = random_instance(rng, 6, 4, n_types=2, offload=True, tight_memory=True, alike=True)
    instance = _with_kv_restore(rng, base)
    brute = brute_force(instance)
    assert any(stage.kv_evicted_bytes > 0 for stage in brute.evaluation.stages)
    assert counts_search(instance, time_limit_s=20).bound <= brute.evaluation.objective * (1 + 1e-9)
    assert solve(instance, time_limit_s=20).evaluation.objective == pytest.approx(brute.evaluation.objective)


def test_split_is_the_cheapest_of_every_split():
    rng = np.random.default_rng(7)
    for _ in range(200):
        kv, rest = rng.uniform(0, 10, size=2)
        memory = rng.uniform(0, kv + rest)
        bw, kv_rate = rng.uniform(0.5, 2.0), rng.uniform(0.1, 3.0)
        seconds, evicted = split_offload(kv + rest, kv, memory, bw, kv_rate)
        over = kv + rest - memory
        grid = np.linspace(max(over - rest, 0.0), min(over, kv), 2001)  # evicted KV, the rest streamed
        oracle = np.min((over - grid) / bw + grid * kv_rate)
        assert float(seconds) == pytest.approx(oracle, rel=1e-9, abs=1e-12)
        assert 0.0 <= float(evicted) <= min(over, kv) + 1e-12


def _pressure_instance():
    return build_instance("llama-2-13b", CLUSTER, "kv-pressure")


def test_bundled_cluster_picks_different_modes_that_brute_force_confirms():
    instance = _pressure_instance()
    assert instance.kv_restore is not None
    index = {d.gpu_type: j for j, d in enumerate(instance.devices)}
    t4, a100 = index["T4"], index["A100-80G"]
    restore = instance.kv_restore
    # T4: under 1 GB/s back to the host makes swapping dearer than recomputing; the A100's Gen4 link wins
    assert restore.recompute_s_per_byte[t4] < restore.swap_s_per_byte[t4]
    assert restore.swap_s_per_byte[a100] < restore.recompute_s_per_byte[a100]
    brute = brute_force(instance)
    milp = solve_milp(instance, mip_gap=0.0, time_limit_s=30)
    assert milp.evaluation.objective == pytest.approx(brute.evaluation.objective, rel=1e-6)
    stages = milp.evaluation.stages
    assert {se.kv_preemption for se in stages} == {"swap", "recompute"}
    assert all(se.kv_evicted_bytes > 0 for se in stages)  # the modes matter on both stages
    for planned, searched in zip(stages, brute.evaluation.stages, strict=True):
        assert planned.stage == searched.stage
        assert planned.kv_preemption == searched.kv_preemption
    # the other mode on any one stage costs more
    for index in range(len(stages)):
        modes = [se.kv_preemption for se in stages]
        modes[index] = "swap" if modes[index] == "recompute" else "recompute"
        other = evaluate(instance, milp.solution.with_kv_modes(modes))
        assert other.objective > milp.evaluation.objective


def test_kv_preemption_off_and_hidden_swap_in_price_streaming_only():
    assert build_instance("llama-2-13b", CLUSTER, "kv-pressure", kv_preemption="off").kv_restore is None
    assert build_instance("llama-2-13b", CLUSTER, "kv-pressure", swap_in="hidden").kv_restore is None
    with pytest.raises(TesselError, match="kv preemption"):
        build_instance("llama-2-13b", CLUSTER, "kv-pressure", kv_preemption="maybe")
    instance = _pressure_instance()
    with pytest.raises(ValueError, match="swap_in"):
        replace(instance, swap_in="hidden")


def test_bundled_cluster_host_links_follow_pcie_generation():
    cluster = load_cluster(CLUSTER)
    assert CLUSTER in list_bundled_clusters()
    t4, a100 = cluster.devices
    assert (t4.gpu_type, a100.gpu_type) == ("T4", "A100-80G")
    assert t4.spec.pcie_h2d_bytes_per_s == pytest.approx(12e9)  # Gen3 cap on the catalog's 12.9
    assert t4.spec.pcie_d2h_bytes_per_s == pytest.approx(1e9)  # the catalog's measured figure, below it
    assert a100.spec.pcie_h2d_bytes_per_s == pytest.approx(25e9)


def _two_nodes(**node_b) -> dict:
    return {
        "name": "x",
        "nodes": [
            {"name": "a", "gpus": {"type": "A100-80G"}, "pcie_gen": 3},
            {"name": "b", "gpus": {"type": "A100-80G"}, **node_b},
        ],
        "network": {"bandwidth_gbps": 25},
    }


def test_pcie_gen_and_measured_host_link():
    cluster = parse_cluster(_two_nodes(host_link={"h2d_gbps": 80, "d2h_gbps": 40}))
    gen3, measured = cluster.devices
    assert gen3.spec.pcie_h2d_bytes_per_s == pytest.approx(12e9)
    assert measured.spec.pcie_h2d_bytes_per_s == pytest.approx(80 * GBPS)
    assert measured.spec.pcie_d2h_bytes_per_s == pytest.approx(40 * GBPS)
    with pytest.raises(TesselError, match="pcie_gen"):
        parse_cluster(_two_nodes(pcie_gen=2))


@pytest.mark.parametrize(
    ("text", "line", "field"),
    [
        ("    host_link: {h2d_gbps: 0, d2h_gbps: 8}\n", 6, "nodes[0].host_link.h2d_gbps"),
        ("    host_link: {h2d_gbps: 96, d2h_gbps: .nan}\n", 6, "nodes[0].host_link.d2h_gbps"),
        ("    pcie_gen: 6\n", 6, "nodes[0].pcie_gen"),
    ],
)
def test_bad_host_link_names_line_and_field(tmp_path, text, line, field):
    path = tmp_path / "cluster.yaml"
    path.write_text("name: bad\nnodes:\n  - name: a\n    gpus: {type: T4}\n    host_memory_gib: 8\n" + text)
    with pytest.raises(TesselError) as error:
        load_cluster(path)
    assert f"cluster.yaml:{line}: {field}" in str(error.value)


def test_bad_network_bandwidth_names_line_and_field(tmp_path):
    path = tmp_path / "cluster.yaml"
    nodes = "nodes:\n  - name: a\n    gpus: {type: T4}\n  - name: b\n    gpus: {type: T4}\n"
    for value in ("0", ".nan"):
        path.write_text(f"name: bad\n{nodes}network: {{bandwidth_gbps: {value}}}\n")
        with pytest.raises(TesselError) as error:
            load_cluster(path)
        assert "cluster.yaml:7: network.bandwidth_gbps" in str(error.value)


def test_plan_stages_carry_the_mode_and_older_stages_load_without_it():
    from tessel.plan.files.plan_parts import PlanStage
    from tessel.plan.report import stage_records

    instance = _pressure_instance()
    evaluation = evaluate(instance, solve_dp(instance).solution)
    records = stage_records(instance, evaluation, load_cluster(CLUSTER))
    stages = [PlanStage.model_validate(record) for record in records]
    assert [s.kv_preemption for s in stages] == [se.kv_preemption for se in evaluation.stages]
    for stage, se in zip(stages, evaluation.stages, strict=True):
        assert math.isclose(stage.kv_evicted_gib, se.kv_evicted_bytes / GIB)
    t4 = next(s for s in stages if s.gpu_type == "T4")
    assert t4.host_d2h_gbps == pytest.approx(1e9 / GBPS)
    new_keys = ("kv_preemption", "kv_evicted_gib", "host_h2d_gbps", "host_d2h_gbps")
    old = {key: value for key, value in records[0].items() if key not in new_keys}
    assert PlanStage.model_validate(old).kv_preemption is None
    with pytest.raises(ValueError, match="kv_evicted_gib"):
        PlanStage.model_validate({**records[0], "kv_evicted_gib": records[0]["offload_gib"] + 1})
    with pytest.raises(ValueError, match="kv_preemption"):
        PlanStage.model_validate({**records[0], "kv_preemption": "drop"})


def test_solution_kv_modes_are_checked():
    instance = _pressure_instance()
    solution = Solution.from_counts([0, 1], [20, 20])
    with pytest.raises(ValueError, match="kv modes"):
        evaluate(instance, solution.with_kv_modes(("swap",)))
    with pytest.raises(ValueError, match="kv modes"):
        evaluate(instance, solution.with_kv_modes(("swap", "drop")))
