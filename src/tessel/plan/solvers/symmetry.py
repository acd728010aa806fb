"""Which devices of a planning instance are exact copies (the DP's device orders and the MILP's
symmetry-breaking rows both use it)."""

from __future__ import annotations

import numpy as np

from tessel.plan.instance import PlanningInstance


def interchangeable(instance: PlanningInstance, a: int, b: int) -> bool:
    """Devices a and b are exact copies: same memory, host link, workspace, unit times, links to
    every other device and, when re-planning, the same cost of moving each unit there (so swapping
    them changes no plan's cost)."""
    da, db = instance.devices[a], instance.devices[b]
    move = instance.move_s
    if move is not None and instance.move_weight > 0 and not np.array_equal(move[:, a], move[:, b]):
        return False
    if (da.memory_bytes, da.host_bytes, da.host_to_device_bytes_per_s) != (
        db.memory_bytes,
        db.host_bytes,
        db.host_to_device_bytes_per_s,
    ):
        return False
    if instance.workspace_bytes[a] != instance.workspace_bytes[b]:
        return False
    if instance.kv_rate_s_per_byte(a) != instance.kv_rate_s_per_byte(b):
        return False
    others = [k for k in range(instance.n_devices) if k not in (a, b)]
    for costs in (instance.prefill, instance.decode):
        if not np.array_equal(costs.unit_time_s[:, a], costs.unit_time_s[:, b]):
            return False
        if costs.first_time_s[a] != costs.first_time_s[b] or costs.last_time_s[a] != costs.last_time_s[b]:
            return False
        if not np.array_equal(costs.send_s[a, others], costs.send_s[b, others]):
            return False
        if not np.array_equal(costs.send_s[others, a], costs.send_s[others, b]):
            return False
        if costs.send_s[a, b] != costs.send_s[b, a]:
            return False
    return True
