"""Two-tier placements: the layers on the fastest GPU type, a few on a slower type for its memory.

Under a TPOT SLO a token must cross every layer within the SLO, so a pipeline's layers belong on
its fastest GPUs; but what a pipeline serves grows with the requests it holds, and their KV needs
memory. A slower GPU that takes s layers frees s layers' weights on the fast ones for KV, at a cost
of s (t_slow - t_fast) per token. So: n1 fast GPUs take U - s layers evenly, n2 slow GPUs of one
other type take s evenly (the fast ones first in the pipeline), for s up to what the TPOT SLO
allows at all (every layer's decode time at the least batch: `max_slow_layers`). The planner's
placements minimise request latency at a count in flight, which spreads layers for balance, not
for KV room; these are the placements an SLO asks for.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from tessel.plan.instance import PlanningInstance
from tessel.plan.online.pipelines import Placement
from tessel.plan.solution import Solution
from tessel.plan.solvers.baselines import units_per_layer, vllm_uniform_counts

SLOW_COUNTS = (1, 2, 4, 8)  # slow GPUs tried per pipeline
LAYERS_PER_SLOW = (1, 2, 3, 4, 6)  # layers per slow GPU tried


def tiered_placements(
    instance: PlanningInstance, free: tuple[int, ...], tpot_slo_s: float
) -> Iterator[Placement]:
    """Fast tier: the free GPUs of the fastest type, every count; slow tier: each other type."""
    by_type = _by_type(instance, free)
    if len(by_type) < 2:
        return
    decode = np.asarray(instance.decode.unit_time_s).mean(axis=0)
    ordered = sorted(by_type.values(), key=lambda members: decode[members[0]])
    fast = ordered[0]
    per = units_per_layer(instance)
    layers = instance.n_units // per
    for slow in ordered[1:]:
        most = max_slow_layers(layers, decode[fast[0]] * per, decode[slow[0]] * per, tpot_slo_s)
        for n1 in range(1, len(fast) + 1):
            for n2 in (n for n in SLOW_COUNTS if n <= len(slow)):
                for s in sorted({n2 * x for x in LAYERS_PER_SLOW if n2 * x <= min(most, layers - n1)}):
                    counts = vllm_uniform_counts(layers - s, n1) + vllm_uniform_counts(s, n2)
                    devices = (*fast[:n1], *slow[:n2])
                    solution = Solution.from_counts(list(range(n1 + n2)), [c * per for c in counts])
                    yield Placement(devices, solution, f"two tiers: {s} layers on {n2} slower GPUs")


def max_slow_layers(layers: int, fast_layer_s: float, slow_layer_s: float, tpot_slo_s: float) -> int:
    """The most layers the slow tier may take with one token's pass through all still within the SLO."""
    extra = slow_layer_s - fast_layer_s
    room = tpot_slo_s - layers * fast_layer_s
    if room < 0:
        return 0
    return layers if extra <= 0 else min(layers, int(room / extra))


def _by_type(instance: PlanningInstance, free: tuple[int, ...]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for j in free:
        out.setdefault(instance.devices[j].gpu_type, []).append(j)
    for members in out.values():
        members.sort(key=lambda j: (instance.devices[j].node, instance.devices[j].name))
    return out
