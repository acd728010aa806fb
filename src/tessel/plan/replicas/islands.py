"""Network islands: the devices a cluster's slow links split into regions.

A cluster spread over regions (Helix's distributed setting: fast links inside a region, a slow one
between regions) plans best with pipelines kept inside a region, and a pipeline that crosses a slow
link plans differently from one of the same GPUs that does not. An island is a connected component of
the devices joined wherever a micro-batch's decode send between them (the planner's
`decode.send_s`) is within `ISLAND_LINK_RATIO` of the fastest send between two nodes; devices of one
node are always joined. A cluster on one network is one island.
"""

from __future__ import annotations

import numpy as np

from tessel.plan.instance import PlanningInstance

# A link at least this many times slower than the fastest link between nodes separates regions: cloud
# regions are 50-100x apart in latency (a 1 ms hop inside one, 50 ms between), while the spread of
# links inside one network (GPUs' PCIe caps on the NIC) stays within a few times.
ISLAND_LINK_RATIO = 10.0


def network_islands(instance: PlanningInstance) -> list[tuple[int, ...]]:
    """The devices grouped by island (module docstring), each island in device order."""
    n = instance.n_devices
    send = np.asarray(instance.decode.send_s, dtype=float)
    nodes = [device.node for device in instance.devices]
    between = [send[j, k] for j in range(n) for k in range(n) if nodes[j] != nodes[k]]
    fastest = min(between, default=0.0)
    parent = list(range(n))

    def root(j: int) -> int:
        while parent[j] != j:
            parent[j] = parent[parent[j]]
            j = parent[j]
        return j

    for j in range(n):
        for k in range(j + 1, n):
            near = max(send[j, k], send[k, j]) <= ISLAND_LINK_RATIO * fastest
            if nodes[j] == nodes[k] or near:
                parent[root(j)] = root(k)
    islands: dict[int, list[int]] = {}
    for j in range(n):
        islands.setdefault(root(j), []).append(j)
    return [tuple(members) for members in sorted(islands.values())]


def island_of(instance: PlanningInstance) -> list[int]:
    """Per device, the index of its island in `network_islands`."""
    index = [0] * instance.n_devices
    for i, members in enumerate(network_islands(instance)):
        for j in members:
            index[j] = i
    return index
