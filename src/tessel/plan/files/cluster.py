"""Cluster files: which GPUs sit on which node, and how they are linked.

    name: mixed-a100-v100-t4
    nodes:
      - name: node-a
        gpus: {type: A100-80G, count: 2}      # or a list of {type, count} for a mixed node
                                              # optional memory_gib: the device's memory when it is
                                              # not the catalog's (as `tessel probe` reads it)
        intra_link: nvlink                    # nvlink | pcie | {bandwidth_gbps: 300, latency_us: 5}
        host_memory_gib: 512                  # host DRAM for offloading (default 0: none)
        pcie_gen: 4                           # optional: the slots' PCIe generation (3, 4, 5) caps each
                                              # GPU's host link at that generation's achieved rate
        host_link: {h2d_gbps: 200, d2h_gbps: 96}   # optional: measured host link per GPU, Gb/s
        emulate: {speed: 0.5}                 # optional: these devices run at half their type's speed
    network: {bandwidth_gbps: 25, latency_us: 20}   # between nodes (required with > 1 node)
    links:                                    # optional: measured links between two nodes
      - {between: [node-a, node-b], bandwidth_gbps: 9.4, latency_us: 85}

Bandwidths in files are gigabits per second (as Ethernet and InfiniBand are sold: 25 Gb/s =
3.125 GB/s); latencies in microseconds. `load_cluster` accepts a path or a bundled name
(`list_bundled_clusters()`); devices are named "<node>/gpu<i>" in file order.

Links between two devices:
- same node, `nvlink`: the smaller per-direction NVLink bandwidth of the two GPUs (catalog);
- same node, `pcie`: peer-to-peer over PCIe at the smaller host-to-device PCIe bandwidth of the
  two (the catalog's slow device-to-host figure is FlexGen's KV offload to host, not P2P DMA);
- same node, explicit `{bandwidth_gbps, latency_us}`: as given;
- different nodes: the pair's measured link from `links` when given (as `tessel probe --ray`
  writes them), else the network; either capped by either GPU's PCIe (the NIC sits behind it).

Host link (GPU <-> host DRAM, for offloaded weights and swapped KV): the catalog's achieved PCIe
figures of the GPU type, capped by the node's `pcie_gen` (a Gen4 card in a Gen3 slot runs at Gen3:
`gpus.PCIE_GEN_ACHIEVED_GBS`), or the node's measured `host_link` when given.

`emulate: {speed: s}` (0.01 <= s <= 1, `plan_file.MIN_EMULATE_SPEED`) on a node makes its devices
plan as s times their type's peak FLOP/s and memory bandwidth: a way to run an uneven plan on one
host (several CPU devices, one of them "slower"). The plan records each stage's `emulate_speed`.
`emulate: {memory_gib: g, host_gbps: b}` makes its devices plan with g GiB of usable memory and a
host link of b Gbit/s each way, and the runtime (on a CPU device) keeps the layers the plan offloads
in a separate host copy, copied in at b Gbit/s (`tessel.engine.weight_stream`): emulation of a
small device with a slow host link on one CPU, never a GPU figure.
`emulate: {schedule: [[seconds, speed], ...]}` changes that speed at the given seconds since the
stage started serving (`speed` holds before the first change): the plan records it as the stage's
`emulate_schedule`, the runtime's stage sleeps by it and the simulator slows the stage by it; the
planner prices `speed` and the server's remap watcher never reads the schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from tessel.catalog.gpus import GpuSpec, get_gpu, with_host_link
from tessel.catalog.yaml_reader import bundled_names, parse_yaml, resolve_file, validate_data
from tessel.cost.link import LinkSpec
from tessel.errors import TesselError
from tessel.plan.files.plan_parts import MIN_EMULATE_HOST_GBPS, MIN_EMULATE_SPEED, check_emulate_schedule
from tessel.units import GBPS, GIB, US_PER_S

# One-way latency of a GPU-to-GPU copy: NVLink ~2 us and PCIe peer-to-peer ~10 us including the
# copy launch (NCCL/NVIDIA p2pBandwidthLatencyTest report a few us over NVLink, ~10 us over PCIe).
NVLINK_LATENCY_S = 2e-6
PCIE_P2P_LATENCY_S = 10e-6
INTRA_LINK_KINDS = ("nvlink", "pcie")
RAY_CLUSTER = "ray"  # `--cluster ray`: the running Ray cluster's machines, probed (a cluster's source)
# Most GPUs in one cluster file. The planner's set-up prices every ordered device pair (quadratic:
# measured in docs/results.md, Limits) and a pipeline of Llama-3-70B has 80 layers, so
# a plan uses far fewer; larger fleets are planned as several clusters (or replicas).
MAX_CLUSTER_DEVICES = 256
MAX_HOST_MEMORY_GIB = 2**20  # 1 PiB of host DRAM per node: beyond any machine
MAX_LINK_GBPS = 1e6  # 1 Pb/s: far above any link (NVLink 4 is 7.2 Tb/s)
MAX_LINK_LATENCY_US = 1e9  # 1000 s
_FILE_MODEL = ConfigDict(extra="forbid", allow_inf_nan=False)


class LinkModel(BaseModel):
    model_config = _FILE_MODEL

    bandwidth_gbps: float = Field(gt=0, le=MAX_LINK_GBPS, description="gigabits per second")
    latency_us: float = Field(default=0.0, ge=0, le=MAX_LINK_LATENCY_US)

    def spec(self) -> LinkSpec:
        return LinkSpec(self.bandwidth_gbps * GBPS, self.latency_us / US_PER_S)


class PairLinkModel(LinkModel):
    """A measured link between two nodes (either direction), overriding `network` for that pair."""

    between: tuple[str, str]


class EmulateModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # at least plan_file.MIN_EMULATE_SPEED: a plan records it and its readers refuse slower stages
    speed: float = Field(
        default=1.0,
        ge=MIN_EMULATE_SPEED,
        le=1,
        allow_inf_nan=False,
        description="fraction of the device type's speed",
    )
    # offload emulation on a CPU host: the device's memory cap and its host link (copies slowed to it)
    memory_gib: float | None = Field(default=None, gt=0, allow_inf_nan=False, description="memory, GiB")
    host_gbps: float | None = Field(  # Gbit/s, as every bandwidth in the file; plan_file's floor
        default=None, ge=MIN_EMULATE_HOST_GBPS, allow_inf_nan=False, description="host link, Gbit/s"
    )
    # speed over time: [[seconds since start, speed], ...], ascending; `speed` holds before the first
    schedule: list[tuple[float, float]] | None = Field(default=None, description="speed changes over time")

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, schedule: list[tuple[float, float]] | None) -> list[tuple[float, float]] | None:
        problem = check_emulate_schedule(schedule)
        if problem:
            raise ValueError(problem)
        return schedule


class HostLinkModel(BaseModel):
    model_config = _FILE_MODEL

    h2d_gbps: float = Field(gt=0, le=MAX_LINK_GBPS, description="host -> device, gigabits per second")
    d2h_gbps: float = Field(gt=0, le=MAX_LINK_GBPS, description="device -> host, gigabits per second")


class GpuGroupModel(BaseModel):
    model_config = _FILE_MODEL

    type: str
    count: int = Field(default=1, ge=1, le=MAX_CLUSTER_DEVICES)
    # each device's memory when it is not the catalog's (what `tessel probe` read, or a CPU's free DRAM)
    memory_gib: float | None = Field(default=None, gt=0, le=MAX_HOST_MEMORY_GIB)

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        try:
            return get_gpu(value).name
        except TesselError as error:
            raise ValueError(str(error)) from None

    @model_validator(mode="after")
    def _above_reserved(self) -> GpuGroupModel:
        reserved_gib = get_gpu(self.type).reserved_bytes / GIB
        if self.memory_gib is not None and self.memory_gib <= reserved_gib:
            raise ValueError(
                f"memory_gib {self.memory_gib:g} is not above the {reserved_gib:g} GiB a {self.type} "
                "reserves (CUDA context, workspaces; gpus.yaml reserved_gib)"
            )
        return self

    def spec(self) -> GpuSpec:
        """The catalog's spec of this type, with `memory_gib` when given."""
        spec = get_gpu(self.type)
        return spec if self.memory_gib is None else replace(spec, memory_bytes=int(self.memory_gib * GIB))


class NodeModel(BaseModel):
    model_config = _FILE_MODEL

    name: str = Field(min_length=1)
    gpus: list[GpuGroupModel] = Field(min_length=1, max_length=MAX_CLUSTER_DEVICES)
    intra_link: Any = "pcie"
    host_memory_gib: float = Field(default=0.0, ge=0, le=MAX_HOST_MEMORY_GIB)
    pcie_gen: Literal[3, 4, 5] | None = None  # caps each GPU's host link (gpus.PCIE_GEN_ACHIEVED_GBS)
    host_link: HostLinkModel | None = None  # measured per-GPU host link; wins over pcie_gen
    emulate: EmulateModel | None = None

    @field_validator("gpus", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, dict) else value

    @field_validator("intra_link")
    @classmethod
    def _link(cls, value: Any, info: ValidationInfo) -> str | LinkModel:
        if isinstance(value, str) and value.lower() in INTRA_LINK_KINDS:
            if value.lower() == "nvlink":
                _check_nvlink(info.data.get("gpus", []))
            return value.lower()
        if isinstance(value, dict):
            try:
                return LinkModel.model_validate(value)
            except ValueError as error:  # pydantic.ValidationError is a ValueError
                raise ValueError(f"{_first_error(error)}; {_LINK_HELP}") from None
        raise ValueError(f"got {_short_repr(value)}; {_LINK_HELP}")


def _check_nvlink(groups: list[GpuGroupModel]) -> None:
    lacking = sorted({group.type for group in groups if get_gpu(group.type).nvlink_bytes_per_s is None})
    if lacking:
        raise ValueError(
            f"nvlink, but {', '.join(lacking)} has no NVLink; "
            "use pcie or {bandwidth_gbps: ..., latency_us: ...}"
        )


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value) if isinstance(value, str | int | float | bool | None) else type(value).__name__
    return text if len(text) <= limit else text[:limit] + "..."


_LINK_HELP = "intra_link must be nvlink, pcie or {bandwidth_gbps: <Gb/s>, latency_us: <us>}"


def _first_error(error: Exception) -> str:
    errors = getattr(error, "errors", None)
    if errors is None:
        return str(error)
    item = errors(include_url=False)[0]
    return f"{'.'.join(str(p) for p in item['loc'])}: {item['msg']}"


class ClusterModel(BaseModel):
    model_config = _FILE_MODEL

    name: str = Field(min_length=1)
    nodes: list[NodeModel] = Field(min_length=1, max_length=MAX_CLUSTER_DEVICES)
    network: LinkModel | None = None
    links: list[PairLinkModel] = Field(default_factory=list, max_length=MAX_CLUSTER_DEVICES**2)

    @model_validator(mode="after")
    def _consistent(self) -> ClusterModel:
        names = [node.name for node in self.nodes]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"node names must be unique; repeated: {', '.join(duplicates)}")
        seen: set[frozenset[str]] = set()
        for index, link in enumerate(self.links):
            pair = frozenset(link.between)
            unknown = [name for name in link.between if name not in names]
            if unknown or len(pair) != 2 or pair in seen:
                why = f"names no node {unknown[0]!r}" if unknown else "is not two other nodes, once each"
                raise ValueError(f"links[{index}]: {list(link.between)} {why}")
            seen.add(pair)
        devices = sum(group.count for node in self.nodes for group in node.gpus)
        if devices > MAX_CLUSTER_DEVICES:
            raise ValueError(
                f"{devices} GPUs; tessel plans clusters of at most {MAX_CLUSTER_DEVICES} GPUs "
                "(split the fleet into several clusters)"
            )
        if len(self.nodes) > 1 and self.network is None:
            raise ValueError(
                "a cluster with several nodes needs network: {bandwidth_gbps: ..., latency_us: ...}"
            )
        return self


@dataclass(frozen=True, slots=True)
class Device:
    name: str  # "<node>/gpu<i>"
    gpu_type: str  # canonical catalog name
    node: str
    spec: GpuSpec  # the catalog's, scaled by emulate_speed
    local_index: int  # i within its node
    emulate_speed: float = 1.0  # the node's `emulate: {speed}`
    # the node's `emulate: {schedule}`: (seconds since serving started, speed) changes, ascending
    emulate_schedule: tuple[tuple[float, float], ...] = ()
    emulate_memory_gib: float | None = None  # the node's `emulate: {memory_gib}` (usable memory cap)
    emulate_host_gbps: float | None = None  # the node's `emulate: {host_gbps}` (host link, Gbit/s)


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    device_names: tuple[str, ...]
    host_memory_bytes: int
    intra_link: str | LinkSpec  # "nvlink", "pcie" or an explicit link


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    nodes: tuple[Node, ...]
    devices: tuple[Device, ...]  # in file order
    network: LinkSpec | None
    source: str = ""
    pair_links: dict[frozenset[str], LinkSpec] = field(default_factory=dict)  # measured, node pairs
    _by_name: dict[str, Device] = field(default_factory=dict, init=False, repr=False, compare=False)
    _nodes_by_name: dict[str, Node] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_name.update({device.name: device for device in self.devices})
        self._nodes_by_name.update({node.name: node for node in self.nodes})

    def device(self, device: str | Device) -> Device:
        name = device.name if isinstance(device, Device) else device
        if name not in self._by_name:
            raise TesselError(
                f"cluster {self.name} has no device {name!r}; devices: {', '.join(self._by_name)}"
            )
        return self._by_name[name]

    def link(self, device_a: str | Device, device_b: str | Device) -> LinkSpec:
        """The link hidden states take from device_a to device_b."""
        a, b = self.device(device_a), self.device(device_b)
        if a.name == b.name:
            return LinkSpec(float("inf"), 0.0)
        pcie = min(a.spec.pcie_h2d_bytes_per_s, b.spec.pcie_h2d_bytes_per_s)
        if a.node != b.node:
            measured = self.pair_links.get(frozenset((a.node, b.node)))
            network = measured or self.network
            assert network is not None  # validated: several nodes need a network
            return LinkSpec(min(network.bandwidth_bytes_per_s, pcie), network.latency_s)
        intra = self._nodes_by_name[a.node].intra_link
        if isinstance(intra, LinkSpec):
            return intra
        if intra == "nvlink":
            nvlink = min(a.spec.nvlink_bytes_per_s or 0.0, b.spec.nvlink_bytes_per_s or 0.0)
            return LinkSpec(nvlink, NVLINK_LATENCY_S)
        return LinkSpec(pcie, PCIE_P2P_LATENCY_S)

    def host_bytes(self, device: str | Device) -> float:
        """Host DRAM a device may offload into: its node's host memory split evenly over its GPUs."""
        node = self._nodes_by_name[self.device(device).node]
        return node.host_memory_bytes / len(node.device_names)

    @property
    def gpu_types(self) -> list[str]:
        """Distinct GPU types in file order."""
        return list(dict.fromkeys(device.gpu_type for device in self.devices))

    @property
    def total_memory_bytes(self) -> int:
        return sum(device.spec.memory_bytes for device in self.devices)


def list_bundled_clusters() -> list[str]:
    return bundled_names("clusters")


def load_cluster(path_or_name: str | Path) -> Cluster:
    """A cluster from a YAML file, or a bundled cluster by name (e.g. "mixed-a100-v100-t4")."""
    text, label = resolve_file(path_or_name, "clusters", "cluster")
    return _build(parse_yaml(text, label, ClusterModel), label)


def parse_cluster(data: dict, *, source: str = "<cluster>") -> Cluster:
    """A cluster from an already-parsed mapping of the same shape as a cluster file."""
    return _build(validate_data(data, source, ClusterModel), source)


def cap_gpu_memory(cluster: Cluster, usable_gib: float, what: str = "the GPU memory cap") -> Cluster:
    """`cluster` with every GPU holding at most `usable_gib` GiB of weights, KV cache and activations
    (its memory becomes the cap plus what it reserves); CPU devices keep theirs. Refuses a cap above
    a GPU's usable memory, and a cluster with no GPU."""
    gpus = [device for device in cluster.devices if device.gpu_type.lower() != "cpu"]
    if not gpus:
        raise TesselError(f"{what} applies to GPUs, but cluster {cluster.name} has none (only CPU devices)")
    if not (math.isfinite(usable_gib) and usable_gib * GIB >= 1):
        raise TesselError(f"{what} must be a positive number of GiB, got {usable_gib:g}")
    cap_bytes = int(usable_gib * GIB)
    over = [device for device in gpus if cap_bytes > device.spec.usable_bytes]
    if over:
        found = ", ".join(
            f"{d.name} ({d.gpu_type}: {d.spec.usable_bytes / GIB:.2f} GiB usable of "
            f"{d.spec.memory_bytes / GIB:.2f} GiB)"
            for d in over
        )
        raise TesselError(f"{what} of {usable_gib:g} GiB is above the memory of {found}; give a smaller cap")
    devices = tuple(
        device
        if device.gpu_type.lower() == "cpu"
        else replace(device, spec=replace(device.spec, memory_bytes=cap_bytes + device.spec.reserved_bytes))
        for device in cluster.devices
    )
    return replace(cluster, devices=devices)


def _host_link_bytes_per_s(node: NodeModel) -> tuple[float, float] | None:
    if node.host_link is None:
        return None
    return node.host_link.h2d_gbps * GBPS, node.host_link.d2h_gbps * GBPS


def _build(model: ClusterModel, source: str) -> Cluster:
    nodes, devices = [], []
    for node in model.nodes:
        names = []
        speed = 1.0 if node.emulate is None else node.emulate.speed
        schedule = tuple(tuple(pair) for pair in (node.emulate.schedule or ())) if node.emulate else ()
        for group in node.gpus:
            for _ in range(group.count):
                spec = with_host_link(group.spec(), node.pcie_gen, _host_link_bytes_per_s(node))
                spec = _emulated_offload(spec.emulated(speed), node.emulate)
                device = Device(
                    f"{node.name}/gpu{len(names)}", group.type, node.name, spec, len(names), speed, schedule
                )
                if node.emulate is not None:
                    device = replace(
                        device,
                        emulate_memory_gib=node.emulate.memory_gib,
                        emulate_host_gbps=node.emulate.host_gbps,
                    )
                devices.append(device)
                names.append(device.name)
        intra = node.intra_link.spec() if isinstance(node.intra_link, LinkModel) else node.intra_link
        nodes.append(Node(node.name, tuple(names), int(node.host_memory_gib * GIB), intra))
    network = model.network.spec() if model.network is not None else None
    pairs = {frozenset(link.between): link.spec() for link in model.links}
    return Cluster(model.name, tuple(nodes), tuple(devices), network, source, pairs)


def _emulated_offload(spec: GpuSpec, emulate: EmulateModel | None) -> GpuSpec:
    """`spec` with the node's emulated memory cap (`memory_gib` usable, above what the type reserves)
    and host link (`host_gbps`, both directions) where the cluster file gives them."""
    if emulate is None:
        return spec
    if emulate.memory_gib is not None:
        spec = replace(spec, memory_bytes=int(emulate.memory_gib * GIB) + spec.reserved_bytes)
    if emulate.host_gbps is not None:
        rate = emulate.host_gbps * GBPS
        spec = replace(spec, pcie_h2d_bytes_per_s=rate, pcie_d2h_bytes_per_s=rate)
    return spec
