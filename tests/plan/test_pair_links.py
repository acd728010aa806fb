"""Measured links between two machines (`links:` in a cluster file, as `tessel probe --ray` writes
them): the planner prices each pair by its own link, so a slow pair changes the split."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessel.errors import TesselError
from tessel.plan.api import make_plan
from tessel.plan.files.cluster import parse_cluster
from tessel.units import GBPS

SLOW_GBPS = 0.01


def _three_machines(links: list[dict]) -> dict:
    return {
        "name": "three",
        "nodes": [{"name": name, "gpus": {"type": "T4", "count": 1}} for name in ("a", "b", "c")],
        "network": {"bandwidth_gbps": 100, "latency_us": 10},
        "links": links,
    }


SLOW_AB = [{"between": ["a", "b"], "bandwidth_gbps": SLOW_GBPS, "latency_us": 5000}]


def test_a_measured_pair_link_overrides_the_network_for_that_pair_only() -> None:
    cluster = parse_cluster(_three_machines(SLOW_AB))
    a, b, c = (f"{name}/gpu0" for name in ("a", "b", "c"))
    assert cluster.link(a, b) == cluster.link(b, a)
    assert cluster.link(a, b).bandwidth_bytes_per_s == pytest.approx(SLOW_GBPS * GBPS)
    assert cluster.link(a, b).latency_s == pytest.approx(5e-3)
    assert cluster.link(a, c).bandwidth_bytes_per_s == pytest.approx(100 * GBPS)
    assert cluster.link(b, c).latency_s == pytest.approx(10e-6)


def test_a_slow_pair_link_changes_the_split() -> None:
    fast = make_plan("llama-3-8b", parse_cluster(_three_machines([])))
    slow = make_plan("llama-3-8b", parse_cluster(_three_machines(SLOW_AB)))
    names = ("a", "b", "c")

    def hops(outcome) -> set[frozenset[str]]:
        order = [names[stage.device] for stage in outcome.result.solution.stages]
        return {frozenset(pair) for pair in zip(order, order[1:], strict=False)}

    assert len(fast.result.solution.stages) == 3  # one T4 holds a third of the model
    assert frozenset(("a", "b")) in hops(fast)  # file order when every link is alike
    assert frozenset(("a", "b")) not in hops(slow)  # the slow pair is not a hop any more
    assert slow.result.evaluation.objective == pytest.approx(fast.result.evaluation.objective, rel=1e-6)


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ([{"between": ["a", "z"], "bandwidth_gbps": 1, "latency_us": 1}], "names no node 'z'"),
        ([{"between": ["a", "a"], "bandwidth_gbps": 1, "latency_us": 1}], "is not two other nodes"),
        (SLOW_AB + [{"between": ["b", "a"], "bandwidth_gbps": 1, "latency_us": 1}], "links[1]"),
        ([{"between": ["a", "b"], "bandwidth_gbps": -1, "latency_us": 1}], "bandwidth_gbps"),
    ],
)
def test_bad_pair_links_are_named(links: list[dict], message: str) -> None:
    with pytest.raises(TesselError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_cluster(_three_machines(links))


def test_the_first_stage_goes_where_it_must_run_at_the_same_objective_on_alike_machines() -> None:
    """A Ray pipeline's stage 0 runs on the command's machine (`PlanSettings.first_node`): the plan is
    moved there (a swap of alike T4 machines: the same objective), or refused naming the node."""
    from tessel.plan.api import PlanSettings

    cluster = parse_cluster(_three_machines([]))
    free = make_plan("llama-3-8b", cluster)
    for node in ("a", "b", "c"):
        pinned = make_plan("llama-3-8b", cluster, settings=PlanSettings(first_node=node))
        first = pinned.result.solution.stages[0].device
        assert cluster.devices[first].node == node
        assert pinned.result.evaluation.objective == pytest.approx(free.result.evaluation.objective, rel=1e-9)
    with pytest.raises(TesselError, match="node z, which the cluster lacks"):
        make_plan("llama-3-8b", cluster, settings=PlanSettings(first_node="z"))


def test_moving_the_first_stage_keeps_the_links_the_solver_chose() -> None:
    """The 3-machine plan's split placed on b, c, d (fast links) and moved to start on a, whose link
    to c is slow: a swap of b and a would put the slow link a-c in the pipeline; the move finds a
    placement at the same objective. Oracle: every placement of the split with its first stage on a."""
    import itertools

    from tessel.plan.solution import evaluate, first_stage_on

    split = make_plan("llama-3-8b", parse_cluster(_three_machines([]))).result.solution
    slow_ac = [{"between": ["a", "c"], "bandwidth_gbps": SLOW_GBPS, "latency_us": 5000}]
    cluster = parse_cluster({**_three_machines(slow_ac), "nodes": [
        {"name": name, "gpus": {"type": "T4", "count": 1}} for name in ("a", "b", "c", "d")
    ]})  # fmt: skip
    instance = make_plan("llama-3-8b", cluster).instance

    def placed(devices: tuple[int, ...]):  # noqa: ANN202 - the split on these devices
        return replace(
            split, stages=tuple(replace(s, device=x) for s, x in zip(split.stages, devices, strict=True))
        )

    on_bcd = placed((1, 2, 3))
    moved, evaluation = first_stage_on(instance, on_bcd, "a")
    assert instance.devices[moved.stages[0].device].node == "a"
    best = min(
        evaluate(instance, placed((0, *rest))).objective for rest in itertools.permutations((1, 2, 3), 2)
    )
    assert evaluation.objective == pytest.approx(best, rel=1e-12)
    assert evaluation.objective == pytest.approx(evaluate(instance, on_bcd).objective, rel=1e-9)
    swapped = evaluate(instance, placed((0, 2, 3))).objective  # what swapping b and a alone gives
    assert swapped > evaluation.objective * 1.01
