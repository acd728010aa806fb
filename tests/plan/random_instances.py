"""Random planning instances for the solver tests."""

from __future__ import annotations

import numpy as np

from tessel.plan.instance import DeviceSlot, PassCosts, PlanningInstance, Unit
from tessel.units import GIB


def random_instance(
    rng: np.random.Generator,
    n_units: int,
    n_devices: int,
    *,
    n_types: int | None = None,
    overlap: bool = False,
    offload: bool = False,
    tight_memory: bool = False,
    micro_batches: int | None = None,
    granularity: str = "layer",
    swap_in: str = "charged",
    alike: bool = False,
    move: bool = False,
) -> PlanningInstance:
    """Devices of a few types on two nodes; times, bytes and links drawn fresh.

    Same-type devices on one node are exact copies (the DP's type orders rely on that). With
    `alike` every unit has the same bytes and times (whole layers of one model); with `move`, a
    re-planning cost: each unit already sits on one device and costs time to move to the others."""
    n_types = n_types or n_devices
    type_of = [j % n_types for j in range(n_devices)]
    node_of = [(j // n_types) % 2 for j in range(n_devices)]
    speed = rng.uniform(0.5, 3.0, size=n_types)
    mem_gib = rng.uniform(2.0, 8.0, size=n_types)
    # host links fast enough that a swap-in can hide under a decode step, so offloading is exercised
    bw = rng.uniform(5e9, 20e9, size=n_types) * (100.0 if offload else 1.0)
    host_gib = rng.uniform(0.5, 4.0, size=n_types) if offload else np.zeros(n_types)  # per type: copies
    if granularity == "sublayer":
        units = tuple(Unit(i // 2, "attention" if i % 2 == 0 else "mlp") for i in range(n_units))
    else:
        units = tuple(Unit(i) for i in range(n_units))
    weight = rng.uniform(0.2, 1.0, size=n_units) * GIB
    kv = rng.uniform(0.05, 0.4, size=n_units) * GIB
    if alike:
        weight, kv = np.full(n_units, weight[0]), np.full(n_units, kv[0])
    total = weight.sum() + kv.sum()
    capacity = sum(mem_gib[t] for t in type_of)
    slack = rng.uniform(0.6, 1.1) if tight_memory else rng.uniform(1.3, 3.0)
    if tight_memory or capacity * GIB < slack * total:
        mem_gib = mem_gib * slack * (total / GIB) / capacity
    work_pre = rng.uniform(0.5, 1.5, size=n_units) * 1e-2
    work_dec = rng.uniform(0.5, 1.5, size=n_units) * 1e-3
    if alike:
        work_pre, work_dec = np.full(n_units, work_pre[0]), np.full(n_units, work_dec[0])

    def pass_costs(work: np.ndarray, scale: float) -> PassCosts:
        unit_time = work[:, None] / speed[type_of][None, :]
        link = np.where(np.equal.outer(node_of, node_of), 1.0, 6.0) * scale * rng.uniform(0.5, 1.5)
        np.fill_diagonal(link, 0.0)
        return PassCosts(
            unit_time_s=unit_time,
            first_time_s=rng.uniform(0, 2, size=n_types)[type_of] * scale,
            last_time_s=rng.uniform(0, 4, size=n_types)[type_of] * scale,
            send_s=link,
        )

    devices = tuple(
        DeviceSlot(
            name=f"node{node_of[j]}/gpu{j}",
            gpu_type=f"T{type_of[j]}",
            node=f"node{node_of[j]}",
            memory_bytes=float(mem_gib[type_of[j]] * GIB),
            host_bytes=float(host_gib[type_of[j]] * GIB),
            host_to_device_bytes_per_s=float(bw[type_of[j]]),
        )
        for j in range(n_devices)
    )
    move_s, move_weight = None, 0.0
    if move:
        home = rng.integers(0, n_devices, size=n_units)
        move_s = rng.uniform(0.01, 0.2, size=(n_units, n_devices))
        move_s[np.arange(n_units), home] = 0.0
        move_weight = float(rng.uniform(0.5, 20.0))
    return PlanningInstance(
        units=units,
        devices=devices,
        prefill=pass_costs(work_pre, 2e-3),
        decode=pass_costs(work_dec, 2e-4),
        weight_bytes=weight,
        kv_bytes=kv,
        workspace_bytes=rng.uniform(0.0, 0.3, size=n_types)[type_of] * GIB,
        first_bytes=float(rng.uniform(0, 0.5) * GIB),
        last_bytes=float(rng.uniform(0, 0.5) * GIB),
        micro_batches=micro_batches or int(rng.integers(1, 6)),
        prefill_weight=float(rng.uniform(0.5, 2.0)),
        decode_weight=float(rng.uniform(1.0, 50.0)),
        overlap=overlap,
        swap_in=swap_in,
        move_s=move_s,
        move_weight=move_weight,
    )


def flagged_instance(
    seed: int, n_units: int, n_devices: int, flags: int, *, rng: np.random.Generator | None = None, **options
) -> PlanningInstance:
    """`random_instance` with its switches packed in bits, as hypothesis draws them: 1 overlap,
    2 offload, 4 tight memory, 8 the hidden swap-in rule, 16 re-planning move costs. Pass `rng` to
    keep drawing from it afterwards (it is then used instead of `seed`)."""
    return random_instance(
        np.random.default_rng(seed) if rng is None else rng,
        n_units,
        n_devices,
        overlap=bool(flags & 1),
        offload=bool(flags & 2),
        tight_memory=bool(flags & 4),
        swap_in="hidden" if flags & 8 else "charged",
        move=bool(flags & 16),
        **options,
    )


def with_precision_choice(
    instance: PlanningInstance, rng: np.random.Generator, n_precisions: int, *, budget: bool, theta: bool
) -> PlanningInstance:
    """`instance` with a weight precision per unit to choose: precision 0 is the instance's own numbers;
    lower ones hold fewer bytes, run at a drawn speed factor per device type, and cost quality.
    Same-type devices keep equal costs (exact copies stay copies)."""
    from dataclasses import replace

    from tessel.plan.instance import PrecisionChoice

    types = sorted({d.gpu_type for d in instance.devices})
    type_index = np.array([types.index(d.gpu_type) for d in instance.devices])
    byte_factor = np.concatenate([[1.0], np.sort(rng.uniform(0.2, 0.7, n_precisions - 1))[::-1]])
    quality = np.zeros((instance.n_units, n_precisions))
    if n_precisions > 1:
        steps = rng.uniform(0.1, 1.0, size=(instance.n_units, n_precisions - 1))
        quality[:, 1:] = np.cumsum(steps, axis=1)

    def times(base: np.ndarray) -> np.ndarray:
        factor = np.ones((len(types), n_precisions))
        factor[:, 1:] = rng.uniform(0.4, 1.2, size=(len(types), n_precisions - 1))
        return base[:, :, None] * factor[type_index][None, :, :]

    prefill, decode = times(instance.prefill.unit_time_s), times(instance.decode.unit_time_s)
    choice = PrecisionChoice(
        names=("fp16", "int8", "int4")[:n_precisions],
        weight_bytes=instance.weight_bytes[:, None] * byte_factor[None, :],
        prefill_time_s=prefill,
        decode_time_s=decode,
        quality=quality,
        quality_budget=float(rng.uniform(0.0, quality.max(axis=1).sum())) if budget else float("inf"),
        theta=float(rng.uniform(0.0, 0.05)) if theta else 0.0,
    )
    return replace(instance, precision=choice)
