"""Machines that join the Ray cluster while a plan serves (`serve --plan P --executor ray --remap
auto`).

Every `check_s` the remap watcher asks Ray for its labelled machines; one the serving cluster does
not hold yet is probed with the others (`tessel.pipeline.ray_probe`: each machine's devices, each
pair's measured link), and the remap decider re-plans on the grown cluster
(`RemapDecider.evaluate_joined`): the plan grows onto the new machine when the model's gain, its
weights' move counted, clears `--remap-threshold`; the new plan is then served live like any remap
(`Supervisor.remap`: no request fails). A machine that joins is probed once; one that leaves is the
lost-stage path's (`RayStages`).
"""

from __future__ import annotations

from tessel.pipeline.ray_probe import probed_cluster
from tessel.pipeline.supervision.ray_stages import connect
from tessel.plan.files.cluster import Cluster

JOIN_CHECK_S = 10.0  # how often Ray is asked for new machines


class MachineJoins:
    """The machines of the serving cluster, and those that joined since."""

    def __init__(self, address: str | None, cluster: Cluster, check_s: float = JOIN_CHECK_S) -> None:
        self.address, self.check_s = address, check_s
        self.known = {node.name for node in cluster.nodes}
        self._checked_s: float | None = None

    def joined(self, now_s: float) -> list[str]:
        """The labelled machines Ray lists that the serving cluster lacks (asked every `check_s`)."""
        if self._checked_s is not None and now_s - self._checked_s < self.check_s:
            return []
        self._checked_s = now_s
        return sorted(set(connect(self.address)) - self.known)

    def grown_cluster(self) -> Cluster:
        """Every machine probed now, the new ones with the others; they count as known from now."""
        cluster = probed_cluster(self.address)
        self.known |= {node.name for node in cluster.nodes}
        return cluster


def serving_cluster(address: str | None, plan) -> Cluster:  # noqa: ANN001 (PlanFile)
    """The Ray cluster as it is now, probed, holding every device the served plan names."""
    cluster = probed_cluster(address)
    plan.check_cluster(cluster)
    return cluster
