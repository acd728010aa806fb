"""Which GPUs may form tensor-parallel stages: groupings of each machine's GPUs.

A stage of degree d is d GPUs of one type on one machine (heads and KV heads divisible by d,
d in {1, 2, 4, 8}, at most `max_tp`). GPUs of one type on one machine are interchangeable (same
spec, same links between them), so a machine's "pool" (its GPUs of one type) is grouped by a
multiset of degrees summing to its count, taken in file order, largest groups first: 8 GPUs as
(4, 2, 1, 1) are gpu0-3, gpu4-5, gpu6 and gpu7. A grouping of the cluster picks one multiset per
pool. `max_tp=1` has exactly one grouping, every GPU alone: the pipeline-only plans.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from tessel.catalog.models import ModelSpec
from tessel.cost.tensor_parallel import allowed_degrees
from tessel.plan.files.cluster import Cluster

# Beyond this many groupings of every pool, each pool is grouped at one degree (module `search`).
MAX_GROUPINGS = 48


@dataclass(frozen=True, slots=True)
class Pool:
    """The GPUs of one type (and memory, speed) on one machine, file order."""

    node: str
    gpu_type: str
    devices: tuple[str, ...]
    degrees: tuple[int, ...]  # the degrees its groups may take

    @property
    def label(self) -> str:
        return f"{self.node} ({len(self.devices)}x {self.gpu_type})"


Grouping = tuple[tuple[str, ...], ...]  # groups of device names, rank order, in cluster file order


def pools(cluster: Cluster, model: ModelSpec, max_tp: int) -> tuple[Pool, ...]:
    """The cluster's pools, each with the degrees the model, `max_tp` and its size allow (a CPU: 1)."""
    found: dict[tuple, list[str]] = {}
    for device in cluster.devices:
        key = (device.node, device.gpu_type, device.spec.memory_bytes, device.emulate_speed)
        found.setdefault(key, []).append(device.name)
    result = []
    for (node, gpu_type, _memory, _speed), names in found.items():
        cpu = gpu_type.lower() == "cpu"
        degrees = (1,) if cpu else tuple(d for d in allowed_degrees(model, max_tp) if d <= len(names))
        result.append(Pool(node, gpu_type, tuple(names), degrees))
    return tuple(result)


def degree_multisets(count: int, degrees: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every multiset of `degrees` summing to `count`, each sorted largest first."""
    found: list[tuple[int, ...]] = []

    def extend(prefix: tuple[int, ...], left: int, largest: int) -> None:
        if left == 0:
            found.append(prefix)
            return
        for d in sorted(degrees, reverse=True):
            if d <= min(left, largest):
                extend((*prefix, d), left - d, d)

    extend((), count, max(degrees))
    return found


def pool_groups(pool: Pool, sizes: tuple[int, ...]) -> tuple[tuple[str, ...], ...]:
    """The pool's GPUs cut into groups of these sizes, in file order."""
    groups, start = [], 0
    for size in sizes:
        groups.append(pool.devices[start : start + size])
        start += size
    return tuple(groups)


def uniform_sizes(pool: Pool, degree: int) -> tuple[int, ...]:
    """The pool at one degree (the largest allowed <= `degree`), its remainder at smaller ones."""
    sizes, left = [], len(pool.devices)
    for d in sorted(pool.degrees, reverse=True):
        if d <= degree:
            while left >= d:
                sizes.append(d)
                left -= d
    return tuple(sizes)


def groupings(cluster_pools: tuple[Pool, ...], limit: int = MAX_GROUPINGS) -> list[Grouping]:
    """Every grouping of the pools (pipeline-only first), or, when there are more than `limit`, every
    choice of one degree per pool; more still: one degree for all pools (module `search`)."""
    per_pool = [degree_multisets(len(p.devices), p.degrees) for p in cluster_pools]
    if math.prod(len(m) for m in per_pool) > limit:
        per_pool = [
            sorted({uniform_sizes(p, d) for d in p.degrees}, key=len, reverse=True) for p in cluster_pools
        ]
    if math.prod(len(m) for m in per_pool) > limit:
        degrees = sorted({d for p in cluster_pools for d in p.degrees})
        choices = [tuple(uniform_sizes(p, d) for p in cluster_pools) for d in degrees]
    else:
        choices = list(itertools.product(*per_pool))
    choices.sort(key=lambda sizes: -sum(len(s) for s in sizes))  # most groups (degree 1) first
    return [_grouping(cluster_pools, sizes) for sizes in dict.fromkeys(choices)]


def _grouping(cluster_pools: tuple[Pool, ...], sizes: tuple[tuple[int, ...], ...]) -> Grouping:
    return tuple(
        group for pool, s in zip(cluster_pools, sizes, strict=True) for group in pool_groups(pool, s)
    )


def every_partition(cluster_pools: tuple[Pool, ...]) -> Iterator[Grouping]:
    """Every partition of every pool's GPUs into groups of allowed sizes, GPUs told apart (the brute
    force's enumeration: no interchangeability assumed)."""

    def partitions(devices: tuple[str, ...], degrees: tuple[int, ...]) -> Iterator[list[tuple[str, ...]]]:
        if not devices:
            yield []
            return
        head, rest = devices[0], devices[1:]
        for d in degrees:
            for mates in itertools.combinations(rest, d - 1):
                left = tuple(x for x in rest if x not in mates)
                for tail in partitions(left, degrees):
                    yield [(head, *mates), *tail]

    for parts in itertools.product(*(list(partitions(p.devices, p.degrees)) for p in cluster_pools)):
        yield tuple(group for part in parts for group in part)
