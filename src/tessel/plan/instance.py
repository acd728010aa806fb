"""The numeric planning problem that every solver (MILP, DP, brute force, baselines) reads.

`tessel.plan.build.build_instance` turns a model, a cluster and a workload into one of these
through the cost model; tests build small ones by hand. Solvers never see a model or a GPU
spec, only these numbers, so MILP, DP and brute force agree on exactly the same problem.

Units are the things placed on devices: whole decoder layers (`granularity="layer"`) or the
attention and MLP blocks of each layer (`"sublayer"`), in model order. A plan assigns each unit
to one device; each used device holds one contiguous run of units; used devices form a
pipeline in the order of their runs.

Per pass (one micro-batch through the pipeline), device j running units U_j costs
    compute_j  = sum_{u in U_j} unit_time[u, j]  (+ first/last extras when j is first/last)
    comm_j     = send_s[j, k] to the next device k (0 on the last stage)
    offload_j  = max(held_j - memory_bytes[j], 0) / host_to_device_bytes_per_s[j]
with held_j = sum weight_bytes + sum kv_bytes + workspace_bytes[j] (+ first/last bytes).
Stage time T_j = compute + comm + offload (additive, the seed's form) or
max(compute, comm, offload) (`overlap=True`, as FlexGen and LLM-PQ treat I/O).

Offloaded bytes stream in from host memory on every pass, and their time is part of T_j in both
swap-in policies. `swap_in="charged"` (the default) stops there: a stage may offload whatever its
host allowance holds and pays the full transfer, as FlexGen does. `swap_in="hidden"` adds the
seed's rule on top: a stage's swap-in must also fit under the upstream stage's work
(compute + comm) in both passes, and the first stage, which has no upstream stage, may not offload.
KV under memory pressure (`kv_restore`, optional): what a stage holds beyond its memory is either
weights (streamed in every pass at host_to_device_bytes_per_s) or evicted KV cache. A pass works on
one of the m micro-batches in flight, so it brings back its share of the evicted KV, 1/m of it, by
the stage's preemption mode: `swap` (out to host and back: `swap_s_per_byte`, both PCIe directions)
or `recompute` (prefill the evicted context again on the stage: `recompute_s_per_byte`, from the
cost model). Per stage, with X the overflow, K its KV bytes and W = held - K the rest:

    kv rate   c_j = min(swap, recompute)[j] / m        (the mode is the cheaper one)
    evicted   e_j = min(X, K) when c_j < 1/B_j, else max(X - W, 0)   (the cheaper bytes leave first)
    offload_j = (X - e_j) / B_j + c_j e_j              (the design's expected offloading latency A_j)

which is the least A_j over every split of X into streamed weights (<= W) and evicted KV (<= K), so
the MILP prices it with continuous variables. Without `kv_restore`, offload_j = X / B_j as above.
`kv_restore` needs `swap_in="charged"`.

Whole streamed layers (`stream_layers`, what tessel's runtime does; `build_instance` sets it with
`swap_in="charged"`): the runtime frees device memory only by streaming whole decoder layers, the
stage's last ones, keeping two of them on the device as buffers, and copies every streamed layer in
on each pass (`tessel.plan.streamed`). So the streamed weights S_j = X - e_j cost
`copied_bytes(layers of the stage, S_j) / B_j` instead of S_j / B_j: about S_j plus two layers,
rounded up to whole layers. `evaluate`, the DP and the brute force price it exactly; the MILP keeps
A_j >= S_j / B_j, a lower bound (whole-layer rounding is not linear in its variables), so its
objective and dual bound are bounds on the exact price and the plan it returns is re-priced by
`evaluate`. Needs `swap_in="charged"`.

Copies that share the compute's cores (`DeviceSlot.copies_share_compute`, set by `build_instance` on a
CPU device): a CPU copies streamed weights with its own cores (under emulation, a side thread copies
and then sleeps out the emulated link), so on such a device the transfer does not overlap compute:
T_j = max(compute + offload, comm) with `overlap=True` (compute + comm + offload without, as for all).

Objective = prefill_weight * (sum_j T_j^pre + (micro_batches - 1) * max_j T_j^pre)
          + decode_weight  * (sum_j T_j^dec + (micro_batches - 1) * max_j T_j^dec)
          + move_weight * sum_u move_s[u, device of u]      (re-planning only; 0 otherwise)
          + theta * sum_u quality[u, precision of u]        (precision choice only; 0 otherwise).

Precision per unit (`precision`, optional): each unit takes one weight precision q of a few
(`PrecisionChoice.names`); its weight bytes and its times on every device are those of q, and it
costs `quality[u, q]` (0 for the reference precision). A plan is feasible only when its total quality
cost is within `quality_budget`. Without a precision choice the base arrays above are the plan's.
With both, the move cost may depend on the precision too: `move_s[u, j, q]`, the seconds to bring
unit u onto device j at precision q (re-planning a plan whose units already have precisions).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

UNIT_KINDS = ("layer", "attention", "mlp")
SWAP_IN_POLICIES = ("charged", "hidden")
KV_PREEMPTION_MODES = ("swap", "recompute")


@dataclass(frozen=True, slots=True)
class Unit:
    """One placeable piece of the model: a decoder layer, or its attention or MLP block."""

    layer: int
    kind: str = "layer"

    def __post_init__(self) -> None:
        if self.kind not in UNIT_KINDS:
            raise ValueError(f"unit kind {self.kind!r} not in {UNIT_KINDS}")


@dataclass(frozen=True, slots=True)
class DeviceSlot:
    """One GPU (or CPU) of the cluster as the solver sees it."""

    name: str  # unique, e.g. "node-a/gpu0"
    gpu_type: str  # catalog name, e.g. "A100-80G"; same-type devices are interchangeable
    node: str
    memory_bytes: float  # usable device memory after reserved (CUDA context etc.)
    host_bytes: float  # host DRAM this device may offload into (0 = no offloading)
    host_to_device_bytes_per_s: float  # the device's own PCIe bandwidth, host -> device
    device_to_host_bytes_per_s: float = 0.0  # device -> host (0: not given; KvRestore prices swaps)
    copies_share_compute: bool = False  # host copies take the compute's cores (a CPU): never overlapped
    # a tensor-parallel stage: the GPUs of its ranks, rank 0 first (= `name`); () is one GPU
    # (`tessel.plan.tp`: memory and host figures are then the ranks' sums, times a rank's plus comm)
    tp_gpus: tuple[str, ...] = ()

    @property
    def tp_degree(self) -> int:
        return max(len(self.tp_gpus), 1)

    @property
    def gpus(self) -> tuple[str, ...]:
        """The GPUs this slot runs on, rank order."""
        return self.tp_gpus or (self.name,)


@dataclass(frozen=True, slots=True)
class PassCosts:
    """Times of one pass (prefill of one micro-batch, or one decode step of one micro-batch)."""

    unit_time_s: np.ndarray  # [U, N]: unit u on device j
    first_time_s: np.ndarray  # [N]: embedding lookup when j is the first stage
    last_time_s: np.ndarray  # [N]: final norm + LM head (+ sampling) when j is the last stage
    send_s: np.ndarray  # [N, N]: hidden states of one micro-batch from j to k (diagonal unused)


@dataclass(frozen=True, slots=True)
class PrecisionChoice:
    """Weight precisions a unit may take, and what each costs (see the module docstring)."""

    names: tuple[str, ...]  # P precisions, the reference (highest) first, e.g. ("fp16", "int8", "int4")
    weight_bytes: np.ndarray  # [U, P]
    prefill_time_s: np.ndarray  # [U, N, P]: unit u on device j at precision q, one prefill pass
    decode_time_s: np.ndarray  # [U, N, P]
    quality: np.ndarray  # [U, P] >= 0: quality cost of unit u at precision q
    quality_budget: float = float("inf")  # most total quality cost a plan may have
    theta: float = 0.0  # seconds of objective per unit of quality cost (LLM-PQ's trade-off weight)

    def check(self, n_units: int, n_devices: int) -> None:
        n = len(self.names)
        if n == 0:
            raise ValueError("a precision choice needs at least one precision")
        _check_shape("precision.weight_bytes", self.weight_bytes, (n_units, n))
        _check_shape("precision.prefill_time_s", self.prefill_time_s, (n_units, n_devices, n))
        _check_shape("precision.decode_time_s", self.decode_time_s, (n_units, n_devices, n))
        _check_shape("precision.quality", self.quality, (n_units, n))
        if np.any(self.quality < 0) or self.theta < 0:
            raise ValueError("quality costs and theta must be >= 0")


@dataclass(frozen=True, slots=True)
class KvRestore:
    """Seconds to bring back one byte of evicted KV cache on each device, per preemption mode."""

    swap_s_per_byte: np.ndarray  # [N]: 1 / device_to_host + 1 / host_to_device (out and back)
    recompute_s_per_byte: np.ndarray  # [N]: prefill seconds of the evicted context per KV byte

    def check(self, n_devices: int) -> None:
        for name in ("swap_s_per_byte", "recompute_s_per_byte"):
            rates = getattr(self, name)
            _check_shape(f"kv_restore.{name}", rates, (n_devices,))
            if not np.all(np.isfinite(rates)) or np.any(rates <= 0):
                raise ValueError(f"kv_restore.{name} must be finite and > 0, got {rates}")

    def subset(self, devices) -> KvRestore:
        """The rates of the devices at these indices, in that order."""
        idx = np.asarray(devices, dtype=int)
        return KvRestore(self.swap_s_per_byte[idx], self.recompute_s_per_byte[idx])

    def modes(self) -> tuple[str, ...]:
        """The cheaper mode per device (swap on ties)."""
        return tuple(
            "recompute" if r < s else "swap"
            for s, r in zip(self.swap_s_per_byte, self.recompute_s_per_byte, strict=True)
        )

    def rate_s_per_byte(self, device: int, mode: str | None) -> float:
        """Seconds per evicted byte on `device` in `mode` (None: the cheaper mode)."""
        swap, recompute = float(self.swap_s_per_byte[device]), float(self.recompute_s_per_byte[device])
        if mode is None:
            return min(swap, recompute)
        if mode not in KV_PREEMPTION_MODES:
            raise ValueError(f"kv preemption mode must be one of {KV_PREEMPTION_MODES}, got {mode!r}")
        return swap if mode == "swap" else recompute


@dataclass(frozen=True, slots=True)
class PlanningInstance:
    units: tuple[Unit, ...]
    devices: tuple[DeviceSlot, ...]
    prefill: PassCosts
    decode: PassCosts
    weight_bytes: np.ndarray  # [U]
    kv_bytes: np.ndarray  # [U]: KV of every in-flight micro-batch at full length (prompt + output)
    workspace_bytes: np.ndarray  # [N]: activation workspace on device j
    first_bytes: float  # embedding table, held by the first stage
    last_bytes: float  # final norm + LM head (0 extra when tied and on one stage), held by the last
    micro_batches: int  # m in flight; 1/alpha_f = m - 1
    prefill_weight: float = 1.0  # relative weight of the prefill makespan (requests per unit time)
    decode_weight: float = 1.0  # weight of one decode makespan (= generated tokens per request)
    overlap: bool = False
    swap_in: str = "charged"  # "charged" or "hidden" (see the module docstring)
    # re-planning: seconds to bring unit u's weights onto device j (0 where they already are), and
    # the weight of that one-time cost against the objective (see tessel.plan.remap.replan)
    move_s: np.ndarray | None = None  # [U, N], or [U, N, P] with a precision choice
    move_weight: float = 0.0
    precision: PrecisionChoice | None = None  # a weight precision per unit, chosen by the solver
    kv_restore: KvRestore | None = None  # evicted KV priced by swap or recompute (module docstring)
    stream_layers: bool = False  # offloaded weights stream as whole layers (module docstring)
    labels: dict[str, str] = field(default_factory=dict)  # model, cluster, workload names for reports

    def __post_init__(self) -> None:
        n_units, n_devices = len(self.units), len(self.devices)
        if n_units == 0 or n_devices == 0:
            raise ValueError("a planning instance needs at least one unit and one device")
        for name, costs in (("prefill", self.prefill), ("decode", self.decode)):
            _check_shape(f"{name}.unit_time_s", costs.unit_time_s, (n_units, n_devices))
            _check_shape(f"{name}.first_time_s", costs.first_time_s, (n_devices,))
            _check_shape(f"{name}.last_time_s", costs.last_time_s, (n_devices,))
            _check_shape(f"{name}.send_s", costs.send_s, (n_devices, n_devices))
        _check_shape("weight_bytes", self.weight_bytes, (n_units,))
        _check_shape("kv_bytes", self.kv_bytes, (n_units,))
        _check_shape("workspace_bytes", self.workspace_bytes, (n_devices,))
        if self.swap_in not in SWAP_IN_POLICIES:
            raise ValueError(f"swap_in must be one of {SWAP_IN_POLICIES}, got {self.swap_in!r}")
        if self.move_s is not None:
            if self.precision is not None and np.ndim(self.move_s) == 3:
                _check_shape("move_s", self.move_s, (n_units, n_devices, len(self.precision.names)))
            else:
                _check_shape("move_s", self.move_s, (n_units, n_devices))
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.precision is not None:
            self.precision.check(n_units, n_devices)
        if self.kv_restore is not None:
            self.kv_restore.check(n_devices)
            if self.swap_in != "charged":
                raise ValueError("kv_restore (swap or recompute of evicted KV) needs swap_in='charged'")
        if self.stream_layers and self.swap_in != "charged":
            raise ValueError("stream_layers (whole streamed layers) needs swap_in='charged'")

    def kv_rate_s_per_byte(self, device: int, mode: str | None = None) -> float | None:
        """Seconds of one pass per byte of evicted KV on `device` (its micro-batch's 1/m share),
        None without `kv_restore`."""
        if self.kv_restore is None:
            return None
        return self.kv_restore.rate_s_per_byte(device, mode) / self.micro_batches

    def offload_bytes_per_s_bound(self, device: int) -> float:
        """The most overflow bytes per second of offload time any split achieves on `device`: a rate
        that keeps `overflow / rate` a lower bound on its offload time."""
        rate = self.devices[device].host_to_device_bytes_per_s
        kv = self.kv_rate_s_per_byte(device)
        return rate if kv is None else max(rate, 1.0 / kv)

    @property
    def n_units(self) -> int:
        return len(self.units)

    @property
    def n_devices(self) -> int:
        return len(self.devices)

    @property
    def n_precisions(self) -> int:
        return 1 if self.precision is None else len(self.precision.names)

    def fixed(self, precisions: tuple[int, ...] | np.ndarray | None) -> PlanningInstance:
        """This instance with each unit's precision fixed (index per unit; None: the reference),
        and no precision left to choose. Its objective lacks the quality term (see `quality_cost`)."""
        choice = self.precision
        if choice is None:
            return self
        q = np.zeros(self.n_units, dtype=int) if precisions is None else np.asarray(precisions, dtype=int)
        units = np.arange(self.n_units)
        return replace(
            self,
            prefill=replace(self.prefill, unit_time_s=choice.prefill_time_s[units, :, q]),
            decode=replace(self.decode, unit_time_s=choice.decode_time_s[units, :, q]),
            weight_bytes=choice.weight_bytes[units, q],
            move_s=self.move_s[units, :, q] if self.precision_move_costs else self.move_s,
            precision=None,
        )

    @property
    def precision_move_costs(self) -> bool:
        """Whether `move_s` is [U, N, P] (the move cost depends on the precision a unit takes)."""
        return self.move_s is not None and np.ndim(self.move_s) == 3

    def relaxed(self) -> PlanningInstance:
        """Each unit at its least bytes and least time over the precisions it may take, no quality
        cost: no plan of this instance costs less there (stage times and memory only grow with unit
        times and bytes). A unit may not take a precision whose cost alone, with every other unit at
        its cheapest, exceeds the budget."""
        choice = self.precision
        if choice is None:
            return self
        cheapest = choice.quality.min(axis=1)
        alone = choice.quality + (cheapest.sum() - cheapest)[:, None]
        allowed = alone <= choice.quality_budget * (1 + 1e-9) + 1e-12
        allowed[np.arange(self.n_units), choice.quality.argmin(axis=1)] = True
        inf = np.inf
        return replace(
            self,
            prefill=replace(
                self.prefill,
                unit_time_s=np.where(allowed[:, None, :], choice.prefill_time_s, inf).min(axis=2),
            ),
            decode=replace(
                self.decode, unit_time_s=np.where(allowed[:, None, :], choice.decode_time_s, inf).min(axis=2)
            ),
            weight_bytes=np.where(allowed, choice.weight_bytes, inf).min(axis=1),
            move_s=np.where(allowed[:, None, :], self.move_s, inf).min(axis=2)
            if self.precision_move_costs
            else self.move_s,
            precision=None,
        )

    def quality_cost(self, precisions: tuple[int, ...] | np.ndarray | None) -> float:
        """Total quality cost of a precision per unit (None: the reference, index 0)."""
        if self.precision is None:
            return 0.0
        q = np.zeros(self.n_units, dtype=int) if precisions is None else np.asarray(precisions, dtype=int)
        return float(self.precision.quality[np.arange(self.n_units), q].sum())


# ---- the problem of a part of the cluster, or of another concurrency ------------------------------


def share(instance: PlanningInstance, micro_batches: int) -> PlanningInstance:
    """The problem of a replica that holds `micro_batches` of the workload's m micro-batches in flight:
    same micro-batch size and pass costs, the KV of its own micro-batches only."""
    if not 1 <= micro_batches <= instance.micro_batches:
        raise ValueError(f"a share is 1..{instance.micro_batches} micro-batches, got {micro_batches}")
    return with_micro_batches(instance, micro_batches)


def with_micro_batches(instance: PlanningInstance, micro_batches: int) -> PlanningInstance:
    """The instance with `micro_batches` of b requests in flight (any count >= 1): same pass costs,
    the KV of that many micro-batches."""
    if micro_batches < 1:
        raise ValueError(f"micro-batches in flight must be >= 1, got {micro_batches}")
    scale = micro_batches / instance.micro_batches
    return replace(instance, micro_batches=micro_batches, kv_bytes=np.asarray(instance.kv_bytes) * scale)


def gpu_memory_only(instance: PlanningInstance) -> PlanningInstance:
    """The instance with no host memory to offload into: every plan holds all in GPU memory."""
    return replace(instance, devices=tuple(replace(d, host_bytes=0.0) for d in instance.devices))


def subset(instance: PlanningInstance, devices: tuple[int, ...]) -> PlanningInstance:
    """The planning problem restricted to some devices (indices re-numbered 0..k-1)."""
    idx = np.asarray(devices, dtype=int)

    def costs(c: PassCosts) -> PassCosts:
        return PassCosts(
            c.unit_time_s[:, idx], c.first_time_s[idx], c.last_time_s[idx], c.send_s[np.ix_(idx, idx)]
        )

    choice = instance.precision
    if choice is not None:
        choice = replace(
            choice, prefill_time_s=choice.prefill_time_s[:, idx], decode_time_s=choice.decode_time_s[:, idx]
        )
    return replace(
        instance,
        devices=tuple(instance.devices[j] for j in devices),
        prefill=costs(instance.prefill),
        decode=costs(instance.decode),
        workspace_bytes=np.asarray(instance.workspace_bytes)[idx],
        move_s=None if instance.move_s is None else instance.move_s[:, idx],
        precision=choice,
        kv_restore=None if instance.kv_restore is None else instance.kv_restore.subset(idx),
    )


def _check_shape(name: str, array: np.ndarray, shape: tuple[int, ...]) -> None:
    if np.shape(array) != shape:
        raise ValueError(f"{name} has shape {np.shape(array)}, expected {shape}")
