"""How a machine's GPUs are wired: `nvidia-smi topo -m`, `nvidia-smi nvlink --status`, or NVML.

    topology = parse_topo_matrix(text)            # the matrix `nvidia-smi topo -m` prints
    status = parse_nvlink_status(text)            # GPU index -> active link speeds (GB/s)
    topology, links = nvml_topology(pynvml, handles)  # the same from NVML; active NVLinks per GPU
    kind, why = topology.intra_link()             # "nvlink" or "pcie" for the cluster file

A pair of GPUs is joined by one of (nvidia-smi's legend, fastest first):

    NV#   a bonded set of # NVLinks (through NVSwitch on DGX A100/H100: every pair NV12 / NV18)
    PIX   at most one PCIe bridge            PXB   several PCIe bridges, no host bridge
    PHB   a PCIe host bridge (the CPU)       NODE  host bridges within one NUMA node
    SYS   PCIe and the SMP link between NUMA nodes (QPI/UPI); older drivers print SOC

The cluster file gives one link kind per node (tessel.plan.files.cluster), so `intra_link` decides:
- every pair NV#: `nvlink`;
- NVLink on a path through all GPUs (a DGX-1's hybrid cube-mesh of V100s, where some pairs have
  no direct NVLink but a pipeline can go from GPU to GPU over NVLink): `nvlink`, the pairs without
  one named in the reason;
- no NVLink, or NVLink groups that no single path covers (bridged pairs of PCIe cards): `pcie`,
  the groups named in the reason (the planner then prices them at PCIe speed, a lower bound).
Pure Python, no torch; NVML is passed in as a module (tests pass fakes).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import permutations

from tessel.errors import TesselError

PCIE_KINDS = ("PIX", "PXB", "PHB", "NODE", "SYS")  # nearest first
LEGACY_KINDS = {"SOC": "SYS"}  # drivers before 384 printed SOC for SYS
SELF = "X"
NVLINK_CELL = re.compile(r"NV(\d+)")
GPU_COLUMN = re.compile(r"GPU(\d+)")
# NVML topology levels (nvmlGpuTopologyLevel_t) -> nvidia-smi's names; INTERNAL is a dual-GPU board.
NVML_LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
NVML_DEVICE_TYPE_GPU = 0  # NVML_NVLINK_DEVICE_TYPE_GPU
NVML_DEVICE_TYPE_SWITCH = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH
NVML_FEATURE_ENABLED = 1
# what newer drivers print under a GPU whose NVLinks are all down (no bridge, a PCIe card)
NO_ACTIVE_LINKS = re.compile(r"all links are inactive", re.IGNORECASE)
MAX_PATH_SEARCH_GPUS = 10  # Hamiltonian path by brute force: 10! orders at most (nodes hold <= 8 GPUs)


@dataclass(frozen=True, slots=True)
class GpuTopology:
    """Pairwise connections of n GPUs, indexed by nvidia-smi / NVML index."""

    pairs: tuple[tuple[str, ...], ...]  # pairs[i][j]: "X" on the diagonal, else "NV12", "PIX", ...
    cpu_affinity: tuple[str, ...] = ()  # per GPU, as printed ("0-19,40-59"); empty when unknown
    numa_affinity: tuple[str, ...] = ()
    source: str = "nvidia-smi topo -m"

    @property
    def gpu_count(self) -> int:
        return len(self.pairs)

    def nvlinks(self, i: int, j: int) -> int:
        """NVLinks between GPUs i and j (0 when they talk over PCIe)."""
        match = NVLINK_CELL.fullmatch(self.pairs[i][j])
        return int(match.group(1)) if match else 0

    def nvlink_pairs(self) -> list[tuple[int, int]]:
        n = self.gpu_count
        return [(i, j) for i in range(n) for j in range(i + 1, n) if self.nvlinks(i, j)]

    def nvlink_groups(self) -> list[tuple[int, ...]]:
        """GPUs connected by NVLink (directly or through other GPUs), groups of two or more."""
        parent = list(range(self.gpu_count))

        def root(i: int) -> int:
            while parent[i] != i:
                i = parent[i]
            return i

        for i, j in self.nvlink_pairs():
            parent[root(i)] = root(j)
        groups: dict[int, list[int]] = {}
        for i in range(self.gpu_count):
            groups.setdefault(root(i), []).append(i)
        return sorted(tuple(g) for g in groups.values() if len(g) > 1)

    def nvlink_path(self) -> tuple[int, ...] | None:
        """An order of all GPUs in which each one reaches the next over NVLink, or None."""
        n = self.gpu_count
        if n < 2 or len(self.nvlink_groups()) != 1 or len(self.nvlink_groups()[0]) != n:
            return None
        if n > MAX_PATH_SEARCH_GPUS:
            return tuple(range(n)) if all(self.nvlinks(i, i + 1) for i in range(n - 1)) else None
        for order in permutations(range(1, n)):  # paths from GPU 0 first, then any start
            path = (0, *order)
            if all(self.nvlinks(a, b) for a, b in zip(path, path[1:], strict=False)):
                return path
        for start in range(1, n):
            rest = [k for k in range(n) if k != start]
            for order in permutations(rest):
                path = (start, *order)
                if all(self.nvlinks(a, b) for a, b in zip(path, path[1:], strict=False)):
                    return path
        return None

    def intra_link(self) -> tuple[str, str]:
        """("nvlink" | "pcie", why) for the cluster file's one link kind per node."""
        n = self.gpu_count
        if n < 2:
            return "pcie", "one GPU: no GPU-to-GPU link"
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
        linked = self.nvlink_pairs()
        if len(linked) == len(pairs):
            counts = sorted({self.nvlinks(i, j) for i, j in pairs})
            return "nvlink", f"every GPU pair is NVLinked ({'/'.join(f'NV{c}' for c in counts)})"
        if not linked:
            kinds = sorted({self.pairs[i][j] for i, j in pairs}, key=PCIE_KINDS.index)
            return "pcie", f"no NVLink: GPU pairs over PCIe ({', '.join(kinds)})"
        path = self.nvlink_path()
        missing = [(i, j) for i, j in pairs if not self.nvlinks(i, j)]
        if path is not None:
            return "nvlink", (
                f"NVLink on a path through every GPU ({' -> '.join(map(str, path))}); "
                f"{len(missing)} of {len(pairs)} pairs have no direct NVLink "
                f"({', '.join(f'{i}-{j}' for i, j in missing[:8])}{', ...' if len(missing) > 8 else ''})"
            )
        groups = "; ".join(",".join(map(str, g)) for g in self.nvlink_groups())
        return "pcie", (
            f"NVLink only within groups of GPUs ({groups}); the cluster file's one link per node "
            "is PCIe, so the planner prices NVLinked pairs at PCIe speed"
        )

    def subset(self, indices: Iterable[int]) -> GpuTopology:
        """The topology of the GPUs `indices` (e.g. CUDA_VISIBLE_DEVICES), in that order."""
        keep = list(indices)
        pick = lambda values: tuple(values[k] for k in keep) if values else ()  # noqa: E731
        return GpuTopology(
            tuple(tuple(self.pairs[i][j] for j in keep) for i in keep),
            pick(self.cpu_affinity),
            pick(self.numa_affinity),
            self.source,
        )

    def as_dict(self) -> dict:
        kind, why = self.intra_link()
        return {
            "source": self.source,
            "matrix": [list(row) for row in self.pairs],
            "nvlink_pairs": [[i, j, self.nvlinks(i, j)] for i, j in self.nvlink_pairs()],
            "nvlink_groups": [list(g) for g in self.nvlink_groups()],
            "cpu_affinity": list(self.cpu_affinity),
            "numa_affinity": list(self.numa_affinity),
            "intra_link": kind,
            "intra_link_reason": why,
        }


def _cell(value: str, row: str, column: str) -> str:
    value = LEGACY_KINDS.get(value, value)
    if value == SELF or value in PCIE_KINDS or NVLINK_CELL.fullmatch(value):
        return value
    raise TesselError(
        f"nvidia-smi topo -m: cell {value!r} (row {row}, column {column}) is not a connection tessel "
        f"understands; expected X, NV<n>, {', '.join(PCIE_KINDS)} (or SOC)"
    )


def parse_topo_matrix(text: str) -> GpuTopology:
    """The GPU-to-GPU part of `nvidia-smi topo -m` (NIC columns and the legend are skipped)."""
    lines = [line for line in text.splitlines() if line.strip()]
    header_at = next(
        (k for k, line in enumerate(lines) if line.split() and GPU_COLUMN.fullmatch(line.split()[0])), None
    )
    if header_at is None:
        shown = lines[0].strip()[:100] if lines else "nothing"
        raise TesselError(
            f"nvidia-smi topo -m printed {shown!r}...; tessel found no header line of GPU columns "
            "(GPU0 GPU1 ... CPU Affinity) to read the topology from"
        )
    header = lines[header_at].split()
    columns = header[: header.index("CPU")] if "CPU" in header else header
    gpu_columns = [c for c in columns if GPU_COLUMN.fullmatch(c)]
    if gpu_columns != [f"GPU{k}" for k in range(len(gpu_columns))]:
        raise TesselError(
            f"nvidia-smi topo -m: GPU columns {' '.join(gpu_columns)} are not "
            f"GPU0..GPU{len(gpu_columns) - 1} in order; tessel does not understand this header"
        )
    rows, cpu, numa = [], [], []
    for line in lines[header_at + 1 :]:
        tokens = line.split()
        if tokens[0].rstrip(":") == "Legend":
            break
        if not GPU_COLUMN.fullmatch(tokens[0]):
            continue  # a NIC row (mlx5_0, NIC0): links from NICs, not needed
        name = tokens[0]
        if name != f"GPU{len(rows)}":
            raise TesselError(f"nvidia-smi topo -m: row {name} where GPU{len(rows)} was expected")
        if len(tokens) < 1 + len(columns):
            raise TesselError(
                f"nvidia-smi topo -m: row {name} has {len(tokens) - 1} cells for {len(columns)} columns "
                f"({line.strip()[:100]!r})"
            )
        cells = tokens[1 : 1 + len(columns)]
        rows.append(tuple(_cell(v, name, c) for v, c in zip(cells, columns, strict=True) if c in gpu_columns))
        extra = tokens[1 + len(columns) :]
        cpu.append(extra[0] if extra else "")
        numa.append(extra[1] if len(extra) > 1 else "")
    if len(rows) != len(gpu_columns):
        raise TesselError(
            f"nvidia-smi topo -m: {len(gpu_columns)} GPU columns but {len(rows)} GPU rows; "
            "tessel does not understand this matrix"
        )
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            if (value == SELF) != (i == j):
                raise TesselError(
                    f"nvidia-smi topo -m: GPU{i} to GPU{j} is {value!r}; X belongs on the diagonal only"
                )
            if rows[j][i] != value:
                raise TesselError(
                    f"nvidia-smi topo -m: GPU{i} to GPU{j} is {value} but GPU{j} to GPU{i} is {rows[j][i]}"
                )
    keep_cpu = tuple(cpu) if any(cpu) else ()
    return GpuTopology(tuple(rows), keep_cpu, tuple(numa) if any(numa) else ())


def parse_nvlink_status(text: str) -> dict[int, tuple[float | None, ...]]:
    """`nvidia-smi nvlink --status`: GPU index -> each link's speed in GB/s (None: inactive)."""
    status: dict[int, list[float | None]] = {}
    current = None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        gpu = re.match(r"GPU (\d+):", stripped)
        if gpu:
            current = int(gpu.group(1))
            status[current] = []
            continue
        if current is not None and NO_ACTIVE_LINKS.search(stripped):
            continue  # "NVML: Unable to retrieve NVLink information as all links are inActive"
        link = re.fullmatch(r"Link (\d+): (.+)", stripped)
        if link is None or current is None:
            raise TesselError(
                f"nvidia-smi nvlink --status printed {stripped[:100]!r}, which tessel does not understand; "
                "expected 'GPU <i>: <name> (UUID: ...)' then 'Link <k>: <speed> GB/s' lines"
            )
        speed = re.fullmatch(r"([\d.]+) GB/s", link.group(2).strip())
        status[current].append(float(speed.group(1)) if speed else None)
    return {gpu: tuple(links) for gpu, links in status.items()}


def nvlink_gbs(status: dict[int, tuple[float | None, ...]]) -> dict[int, float]:
    """Per GPU, the sum of its active links' speeds (GB/s per direction, as nvidia-smi reports them)."""
    return {gpu: sum(s for s in links if s) for gpu, links in status.items()}


# ---- NVML (nvidia-ml-py) --------------------------------------------------------------------


def _bus_id(value: object) -> str:
    raw = getattr(value, "busId", value)
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.strip().lower()[-12:]  # "00000000:07:00.0" and "0000:07:00.0" alike


def nvml_topology(nvml, handles: list) -> tuple[GpuTopology, dict[int, int]]:  # noqa: ANN001
    """Topology and active NVLinks per GPU of `handles` (NVML index order), read through the module `nvml`.

    Direct NVLinks count per peer GPU (by PCI bus id); links to an NVSwitch join every pair of
    switch-attached GPUs with as many links as the one with fewer has (DGX A100: 12 each, NV12).
    """
    n = len(handles)
    bus = [_bus_id(nvml.nvmlDeviceGetPciInfo(h)) for h in handles]
    direct = [[0] * n for _ in range(n)]
    switch_links = [0] * n
    active_links: dict[int, int] = {}
    for i, handle in enumerate(handles):
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                active = nvml.nvmlDeviceGetNvLinkState(handle, link) == NVML_FEATURE_ENABLED
            except nvml.NVMLError:
                break  # no such link (or no NVLink on this GPU)
            if not active:
                continue
            active_links[i] = active_links.get(i, 0) + 1
            kind = _remote_type(nvml, handle, link)
            if kind == NVML_DEVICE_TYPE_SWITCH:
                switch_links[i] += 1
            elif kind == NVML_DEVICE_TYPE_GPU:
                peer = _bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link))
                if peer in bus:
                    direct[i][bus.index(peer)] += 1
    pairs = []
    for i in range(n):
        row = []
        for j in range(n):
            if i == j:
                row.append(SELF)
                continue
            links = direct[i][j] + min(switch_links[i], switch_links[j])
            if links:
                row.append(f"NV{links}")
            else:
                level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                if level not in NVML_LEVELS:
                    raise TesselError(f"NVML reported topology level {level!r} for GPUs {i}, {j}; unknown")
                row.append(NVML_LEVELS[level])
        pairs.append(tuple(row))
    return GpuTopology(tuple(pairs), source="NVML"), active_links


def _remote_type(nvml, handle, link: int) -> int:  # noqa: ANN001
    getter = getattr(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", None)
    if getter is None:
        return NVML_DEVICE_TYPE_GPU
    try:
        return int(getter(handle, link))
    except nvml.NVMLError:
        return NVML_DEVICE_TYPE_GPU
