"""Network islands: the regions slow links split a cluster into, and the replica search's use of them."""

from __future__ import annotations

from collections import Counter

from tessel.plan.build import build_instance
from tessel.plan.replicas.islands import island_of, network_islands
from tessel.plan.replicas.replicas import _candidate_splits, _Planner, share


def _types(instance, members) -> Counter:
    return Counter(instance.devices[j].gpu_type for j in members)


def test_helix_like_24_splits_into_its_three_regions() -> None:
    instance = build_instance("llama-2-70b", "helix-like-24", "offline-batch")
    islands = network_islands(instance)
    assert [_types(instance, island) for island in islands] == [
        Counter({"A100-80G": 4}),
        Counter({"L4": 2, "T4": 8}),
        Counter({"L4": 6, "T4": 4}),
    ]
    regions = [{instance.devices[j].node.split("-")[0] for j in island} for island in islands]
    assert regions == [{"r1"}, {"r2"}, {"r3"}]


def test_one_network_is_one_island() -> None:
    for cluster in ("helix-like-42", "mixed-a100-v100-t4"):
        instance = build_instance("llama-2-70b", cluster, "offline-batch")
        assert network_islands(instance) == [tuple(range(instance.n_devices))]


def test_replica_search_proposes_the_regions_and_tells_them_apart() -> None:
    """Each region whole is a candidate split, and two L4s in one region do not share a plan with two
    L4s on either side of the slow link."""
    instance = build_instance("llama-2-70b", "helix-like-24", "offline-batch")
    islands = [list(island) for island in network_islands(instance)]
    splits = _candidate_splits(share(instance, 1))
    assert splits[0] == islands  # every region holds the model in GPU memory: each is a pipeline
    planner = _Planner(instance, 8, "milp", 1.0, 0.01)
    island = island_of(instance)
    l4 = [j for j, d in enumerate(instance.devices) if d.gpu_type == "L4"]
    same = [j for j in l4 if island[j] == island[l4[-1]]][:2]
    across = [l4[0], l4[-1]]
    assert island[across[0]] != island[across[1]]
    assert planner.signature(tuple(same)) != planner.signature(tuple(across))
