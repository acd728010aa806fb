"""The search over degrees (`solve_tp`) against brute force over every partition of every machine's GPUs
and every plan of it, on small clusters; and the bound over degrees is a bound."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plan.tp_cases import cluster, problem, small_model, workload
from tessel.plan.solvers.brute import brute_force
from tessel.plan.solvers.solve import solve
from tessel.plan.tp.brute import brute_force_tp
from tessel.plan.tp.groups import degree_multisets, every_partition, groupings, pools
from tessel.plan.tp.search import quick_bound, solve_tp
from tessel.plan.tp.tp_instance import tp_instance

CASES = {
    # (nodes, workload, layers): TP pays on NVLink; across PCIe and a slow pair the choice differs
    "a100-pair-t4-pair": ((("a", "A100-80G", 2, "nvlink"), ("b", "T4", 2, "pcie")), workload(4, 2), 4),
    "three-v100": ((("v", "V100-32G", 3, "nvlink"),), workload(8, 4, prompt=512, output=32), 5),
    "one-stream-t4": ((("t", "T4", 2, "pcie"), ("a", "A100-40G", 2, "nvlink")), workload(1, 1), 4),
    # 18 layers and their KV overflow two T4s: some stream from host memory, alone or at TP 2
    "t4-pair-offload": ((("t", "T4", 2, "pcie"),), workload(8, 2, prompt=1024), 18),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("solver", ["dp", "milp"])
def test_search_over_degrees_equals_brute_force(name: str, solver: str) -> None:
    nodes, the_workload, layers = CASES[name]
    the_cluster = cluster(*nodes, host_gib=16)
    base, ctx = problem(small_model(layers), the_cluster, the_workload)
    oracle = brute_force_tp(base, ctx, max_tp=8)
    found = solve_tp(base, ctx, 8, solver=solver, time_limit_s=20, mip_gap=0.0)
    assert found.result.evaluation.objective == pytest.approx(oracle.evaluation.objective, rel=1e-6)
    assert found.bound is not None and found.bound <= oracle.evaluation.objective * (1 + 1e-6)
    assert found.complete
    # the pipeline-only plan is the brute force over single GPUs
    alone = brute_force_tp(base, ctx, max_tp=1)
    assert found.pipeline_only.evaluation.objective == pytest.approx(alone.evaluation.objective, rel=1e-6)


def test_brute_force_tells_gpus_apart_and_the_search_does_not_need_to() -> None:
    the_cluster = cluster(("v", "V100-32G", 3, "nvlink"), ("t", "T4", 2, "pcie"))
    the_pools = pools(the_cluster, small_model(), 8)
    assert [p.degrees for p in the_pools] == [(1, 2), (1, 2)]
    # 3 GPUs: alone, or one of 3 pairs; 2 GPUs: alone or one pair -> 4 x 2 partitions, 2 x 2 multisets
    assert len(list(every_partition(the_pools))) == 8
    assert (
        len(groupings(the_pools)) == 4 == len(degree_multisets(3, (1, 2))) * len(degree_multisets(2, (1, 2)))
    )
    assert groupings(the_pools)[0] == tuple((d.name,) for d in the_cluster.devices)  # pipeline-only first


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("overlap", [False, True])
def test_quick_bound_is_below_every_grouping_optimum(name: str, overlap: bool) -> None:
    nodes, the_workload, layers = CASES[name]
    the_cluster = cluster(*nodes, host_gib=16)
    base, ctx = problem(small_model(layers), the_cluster, the_workload, overlap=overlap)
    for grouping in groupings(pools(the_cluster, ctx.model, 8)):
        instance = tp_instance(base, ctx, grouping)
        best = solve(instance, solver="brute")
        assert quick_bound(instance) <= best.evaluation.objective * (1 + 1e-9)


def test_max_tp_one_is_the_pipeline_only_problem() -> None:
    the_cluster = cluster(("a", "A100-80G", 2, "nvlink"), ("b", "T4", 2, "pcie"), host_gib=16)
    base, ctx = problem(small_model(4), the_cluster, workload(4, 2))
    found = solve_tp(base, ctx, 1, solver="dp", time_limit_s=10, mip_gap=0.0)
    direct = solve(base, solver="dp", time_limit_s=10, mip_gap=0.0)
    assert found.instance is base and found.result.solution == direct.solution
    assert found.degrees == (1,) * len(direct.evaluation.stages)


GPU_TYPES = (("T4", "pcie"), ("L4", "pcie"), ("V100-32G", "nvlink"), ("A100-40G", "nvlink"))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3)), min_size=1, max_size=2),
    batch=st.integers(1, 8),
    micro_batches=st.integers(1, 4),
    layers=st.integers(3, 5),
    overlap=st.booleans(),
    host_gib=st.sampled_from([0, 16]),
)
def test_random_small_clusters_match_brute_force(
    nodes, batch, micro_batches, layers, overlap, host_gib
) -> None:
    spec = [(f"n{i}", GPU_TYPES[t][0], count, GPU_TYPES[t][1]) for i, (t, count) in enumerate(nodes)]
    the_cluster = cluster(*spec, host_gib=host_gib)
    base, ctx = problem(
        small_model(layers), the_cluster, workload(batch, micro_batches, prompt=1024), overlap=overlap
    )
    oracle = brute_force_tp(base, ctx, max_tp=8)
    if oracle.evaluation is None:
        return  # nothing fits (no host memory): solve_tp refuses, as tested elsewhere
    for grouping in groupings(pools(the_cluster, ctx.model, 8)):  # the quick bound is a bound
        instance = tp_instance(base, ctx, grouping)
        found = brute_force(instance)
        if found.evaluation is not None:
            assert quick_bound(instance) <= found.evaluation.objective * (1 + 1e-9)
    found = solve_tp(base, ctx, 8, solver="dp", time_limit_s=20, mip_gap=0.0)
    assert found.result.evaluation.objective == pytest.approx(oracle.evaluation.objective, rel=1e-6)
    assert found.bound <= oracle.evaluation.objective * (1 + 1e-6)
