"""This machine as a cluster: its CUDA GPUs (from `nvidia-smi`) plus its CPU as one more device.

    machine = discover_machine()          # nvidia-smi, /proc/cpuinfo, /proc/meminfo
    data = cluster_data(machine)          # a mapping of the cluster-file shape (tessel.plan.files.cluster)
    text = cluster_yaml(machine)          # the same as a cluster file, with what was found in comments

No torch: GPUs come from NVML (`nvidia-ml-py`, imported only here and only when installed) or else
`nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits` (`TESSEL_NVIDIA_SMI`
names another executable, e.g. a fake in tests, and then NVML is not tried). No `nvidia-smi`, or one
that fails (no driver, no device), gives a machine without GPUs and a note saying why. Each GPU's
name is mapped to a catalog type (`GPU_NAME_RULES`); a GPU no rule knows is refused, naming it.
Their wiring comes from NVML, or `nvidia-smi topo -m` and `nvidia-smi nvlink --status`
(`tessel.catalog.gpu_topology`); a topology nvidia-smi cannot give is a note, one it prints in a
format tessel does not understand is refused, naming what was not understood.

The cluster it describes (names as `tessel.plan.files.cluster` gives them):
- node `localhost`: the GPUs in CUDA order, `localhost/gpu<K>` being `cuda:K` (the nvidia-smi index,
  or the position in `CUDA_VISIBLE_DEVICES` when that is set), each with the memory nvidia-smi
  reports; linked by `nvlink` or `pcie` as the topology says (`GpuTopology.intra_link`); without a
  topology, by NVLink when every GPU's catalog type has it and none is a PCIe card (an assumption);
- node `localhost-cpu`: the CPU, catalog type `cpu`, with the DRAM free now (MemAvailable) as its
  memory; `localhost-cpu/gpu0` is the CPU's device name;
- between them the `network`: PCIe at the fastest GPU's catalog host-to-device rate (the cluster
  caps each GPU's link at its own), 10 us. An assumption: hidden states cross PCIe through pinned
  host buffers as fast as the catalog's achieved copy rate, the same either way.
Speeds (FLOP/s, memory bandwidth) the planner reads are the catalog's figures for each type; what
`tessel probe` measures goes into the file's comments and its profile JSON, and `tessel profile`
times a layer on a device. Host memory for offloading is 0: the CPU is a device instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tessel.catalog.gpu_topology import GpuTopology, nvml_topology, parse_nvlink_status, parse_topo_matrix
from tessel.catalog.gpus import GB, get_gpu, known_gpus
from tessel.errors import TesselError
from tessel.units import GIB

CLUSTER_NAME = "local"
GPU_NODE = "localhost"
CPU_NODE = "localhost-cpu"
CPU_TYPE = "cpu"
NVIDIA_SMI_ENV = "TESSEL_NVIDIA_SMI"  # another executable than `nvidia-smi` (a fake in tests)
NVIDIA_SMI_QUERY = ("--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits")
NVIDIA_SMI_TOPOLOGY = ("topo", "-m")
NVIDIA_SMI_NVLINK = ("nvlink", "--status")
NVIDIA_SMI_TIMEOUT_S = 30.0  # nvidia-smi answers in well under a second when the driver is healthy
MIB = 2**20
PROC_ROOT = Path("/proc")
# A pinned host<->device copy's one-way latency including its launch: ~10 us, the figure tessel.plan.
# cluster uses for PCIe peer-to-peer (NVIDIA p2pBandwidthLatencyTest reports ~10 us over PCIe).
HOST_LINK_LATENCY_US = 10.0
BITS_PER_BYTE = 8
# Vector and matrix extensions worth naming from /proc/cpuinfo's flags (x86) or Features (Arm).
CPU_ISA_FLAGS = (
    "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "asimd", "sve", "sve2",
)  # fmt: skip
# nvidia-smi name (upper case, "NVIDIA"/"Tesla"/"GeForce" kept) -> catalog type, first match wins.
# A type with several memory sizes picks by the memory nvidia-smi reports: (limit GiB, below, else).
GPU_NAME_RULES: tuple[tuple[str, str | tuple[float, str, str]], ...] = (
    (r"\bH200\b", "H200"),
    (r"\bH100\b", "H100"),
    (r"\bA100\b", (60.0, "A100-40G", "A100-80G")),
    (r"\bA10\b", "A10"),  # not A10G (AWS's variant, other figures) nor A100
    (r"\bL4\b", "L4"),  # not L40 / L40S
    (r"\bT4\b", "T4"),
    (r"\bV100S?\b", (24.0, "V100-16G", "V100-32G")),
    (r"\bRTX 4090\b", "RTX-4090"),
)


@dataclass(frozen=True, slots=True)
class LocalGpu:
    cuda_index: int  # K in cuda:K (the device name's localhost/gpu<K>)
    smi_index: int  # nvidia-smi's index (the same unless CUDA_VISIBLE_DEVICES reorders)
    name: str  # as nvidia-smi prints it
    memory_bytes: int  # nvidia-smi's memory.total
    gpu_type: str  # the catalog type

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


@dataclass(frozen=True, slots=True)
class LocalCpu:
    model_name: str
    logical_cores: int  # "processor" entries in /proc/cpuinfo
    isa: tuple[str, ...]  # the CPU_ISA_FLAGS it has
    memory_total_bytes: int  # MemTotal
    memory_available_bytes: int  # MemAvailable: what the CPU device gets

    @property
    def memory_gib(self) -> float:
        """The CPU device's memory: MemAvailable, rounded down to 0.01 GiB."""
        return int(self.memory_available_bytes / GIB * 100) / 100


@dataclass(frozen=True, slots=True)
class LocalMachine:
    gpus: tuple[LocalGpu, ...]
    cpu: LocalCpu
    notes: tuple[str, ...] = ()  # what discovery could not read, e.g. why there are no GPUs
    topology: GpuTopology | None = None  # of `gpus`, in CUDA order; None when it could not be read
    nvlink_gbs: tuple[float, ...] = ()  # per GPU (CUDA order): its active NVLinks' summed GB/s
    nvlink_active: tuple[int, ...] = ()  # per GPU: active NVLinks
    source: str = "nvidia-smi"  # "NVML" or "nvidia-smi": where the GPUs were read


@dataclass(frozen=True, slots=True)
class SmiRow:
    index: int
    name: str
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class GpuReport:
    """What NVML or nvidia-smi said about the GPUs, by nvidia-smi index."""

    rows: list[SmiRow]
    topology: GpuTopology | None = None
    nvlink_gbs: dict[int, float] = field(default_factory=dict)
    nvlink_active: dict[int, int] = field(default_factory=dict)
    source: str = "nvidia-smi"


def discover_machine(
    *,
    nvidia_smi: str | None = None,
    nvml: object | None = None,
    proc_root: Path = PROC_ROOT,
    environ: Mapping[str, str] | None = None,
) -> LocalMachine:
    """This machine's GPUs, their wiring and its CPU. `nvml`: an NVML module (default: pynvml when
    installed and no nvidia-smi is named); `nvidia_smi`: the executable (default $TESSEL_NVIDIA_SMI or
    nvidia-smi); `proc_root`: where cpuinfo and meminfo are; `environ`: for CUDA_VISIBLE_DEVICES."""
    environ = os.environ if environ is None else environ
    named_smi = nvidia_smi or environ.get(NVIDIA_SMI_ENV)
    report, notes = None, ()
    if nvml is None and not named_smi:
        nvml = _import_nvml()
    if nvml is not None:
        report, notes = read_nvml(nvml)
    if report is None:
        report, smi_notes = read_nvidia_smi(named_smi or "nvidia-smi")
        notes += smi_notes
    rows = report.rows
    if rows:
        rows, visible_notes = visible_rows(rows, environ.get("CUDA_VISIBLE_DEVICES"))
        notes += visible_notes
    gpus = tuple(
        LocalGpu(k, row.index, row.name, row.memory_bytes, catalog_gpu_type(row.name, row.memory_bytes))
        for k, row in enumerate(rows)
    )
    position = {row.index: k for k, row in enumerate(report.rows)}
    topology = None
    if report.topology is not None and gpus:
        topology = report.topology.subset(position[g.smi_index] for g in gpus)
    cpu = parse_cpu(_read_proc(proc_root, "cpuinfo"), _read_proc(proc_root, "meminfo"))
    return LocalMachine(
        gpus,
        cpu,
        notes,
        topology,
        tuple(report.nvlink_gbs.get(g.smi_index, 0.0) for g in gpus) if report.nvlink_gbs else (),
        tuple(report.nvlink_active.get(g.smi_index, 0) for g in gpus) if report.nvlink_active else (),
        report.source,
    )


def _import_nvml() -> object | None:
    try:
        import pynvml  # nvidia-ml-py: optional (`pip install nvidia-ml-py`)
    except ImportError:
        return None
    return pynvml


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_nvml(nvml) -> tuple[GpuReport | None, tuple[str, ...]]:  # noqa: ANN001 (the pynvml module)
    """GPUs and topology through NVML; (None, note) when NVML cannot start (no driver)."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        return None, (f"NVML could not start ({error}); asked nvidia-smi instead",)
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        rows = [
            SmiRow(i, _text(nvml.nvmlDeviceGetName(h)).strip(), int(nvml.nvmlDeviceGetMemoryInfo(h).total))
            for i, h in enumerate(handles)
        ]
        if not rows:
            return GpuReport([], source="NVML"), ("NVML found no GPU",)
        topology, active = nvml_topology(nvml, handles)
    except nvml.NVMLError as error:
        raise TesselError(f"NVML failed while reading the GPUs ({error}); try `nvidia-smi topo -m`") from None
    finally:
        nvml.nvmlShutdown()
    return GpuReport(rows, topology, nvlink_active=active, source="NVML"), ()


def read_nvidia_smi(executable: str) -> tuple[GpuReport, tuple[str, ...]]:
    """GPUs from the query, then their topology (`topo -m`) and NVLink status (`nvlink --status`)."""
    text, notes = run_nvidia_smi(executable)
    rows = parse_nvidia_smi(text) if text is not None else []
    if not rows:
        return GpuReport(rows), notes
    topo_text, topo_notes = run_nvidia_smi(
        executable, NVIDIA_SMI_TOPOLOGY, "GPU links assumed from the catalog types"
    )
    topology = parse_topo_matrix(topo_text) if topo_text is not None else None
    if topology is not None and topology.gpu_count != len(rows):
        raise TesselError(
            f"nvidia-smi topo -m shows {topology.gpu_count} GPUs but the GPU query lists {len(rows)}; "
            "tessel does not understand this machine's report"
        )
    link_text, link_notes = run_nvidia_smi(executable, NVIDIA_SMI_NVLINK, "NVLink status not read")
    status = parse_nvlink_status(link_text) if link_text is not None else {}
    gbs = {gpu: sum(speed for speed in links if speed) for gpu, links in status.items()}
    active = {gpu: sum(1 for speed in links if speed) for gpu, links in status.items()}
    return GpuReport(rows, topology, gbs, active), notes + topo_notes + link_notes


def run_nvidia_smi(
    executable: str, args: tuple[str, ...] = NVIDIA_SMI_QUERY, without: str = "no GPUs"
) -> tuple[str | None, tuple[str, ...]]:
    """(stdout, notes) of `nvidia-smi args`; stdout None with a note (ending in `without`) when there
    is no usable nvidia-smi."""
    path = shutil.which(executable)
    if path is None:
        return None, (f"{executable} not found: no NVIDIA driver here, so {without}",)
    command = f"{executable} {' '.join(args[:2])}" if args != NVIDIA_SMI_QUERY else executable
    try:
        result = subprocess.run([path, *args], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, (f"{command} gave no answer in {NVIDIA_SMI_TIMEOUT_S:g} s: {without}",)
    except OSError as error:
        return None, (f"{command} could not run ({error.strerror or error}): {without}",)
    if result.returncode != 0:
        said = (result.stderr.strip() or result.stdout.strip() or "no message").splitlines()[0]
        return None, (f"{command} exited {result.returncode} ({said}): {without}",)
    return result.stdout, ()


def parse_nvidia_smi(text: str) -> list[SmiRow]:
    """Rows of `index, name, memory.total` (MiB); a line of another shape is refused, quoted."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 3 or not fields[0].isdigit() or not fields[2].isdigit() or not fields[1]:
            raise TesselError(
                f"nvidia-smi printed {line.strip()[:120]!r}, which tessel does not understand; expected "
                f"'index, name, memory MiB' (from nvidia-smi {' '.join(NVIDIA_SMI_QUERY)})"
            )
        rows.append(SmiRow(int(fields[0]), fields[1], int(fields[2]) * MIB))
    return rows


def visible_rows(
    rows: list[SmiRow], cuda_visible_devices: str | None
) -> tuple[list[SmiRow], tuple[str, ...]]:
    """The GPUs CUDA shows under CUDA_VISIBLE_DEVICES (a list of nvidia-smi indices), in its order."""
    if cuda_visible_devices is None:
        return rows, ()
    wanted = [item.strip() for item in cuda_visible_devices.split(",") if item.strip()]
    if not wanted:
        return [], ("CUDA_VISIBLE_DEVICES is empty: CUDA sees no GPU, so no GPUs",)
    by_index = {row.index: row for row in rows}
    if not all(item.isdigit() and int(item) in by_index for item in wanted):
        raise TesselError(
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: tessel reads GPU indices that nvidia-smi lists "
            f"({', '.join(str(row.index) for row in rows)}), not UUIDs or MIG names; give indices or unset it"
        )
    note = f"CUDA_VISIBLE_DEVICES={cuda_visible_devices}: cuda:K is the K-th GPU of that list"
    return [by_index[int(item)] for item in wanted], (note,)


def catalog_gpu_type(name: str, memory_bytes: int) -> str:
    """The catalog type of a GPU that nvidia-smi names `name` with `memory_bytes` of memory."""
    upper = name.upper()
    for pattern, rule in GPU_NAME_RULES:
        if re.search(pattern, upper):
            if isinstance(rule, str):
                return rule
            limit_gib, below, other = rule
            return below if memory_bytes / GIB < limit_gib else other
    known = ", ".join(gpu for gpu in known_gpus() if gpu != CPU_TYPE)
    raise TesselError(
        f"GPU {name!r} ({memory_bytes / GIB:.1f} GiB) is not in tessel's catalog (known: {known}). "
        "Add it: an entry with its datasheet figures in tessel/catalog/gpus.yaml and a name rule in "
        "GPU_NAME_RULES (tessel/catalog/local_machine.py); or write the cluster file by hand with the "
        "nearest catalog type (docs/planner.md)"
    )


def parse_cpu(cpuinfo: str, meminfo: str) -> LocalCpu:
    """The CPU from the text of /proc/cpuinfo and /proc/meminfo."""
    model, cores, flags = "unknown CPU", 0, set()
    for line in cpuinfo.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "processor":
            cores += 1
        elif key in ("model name", "Hardware") and model == "unknown CPU":
            model = value
        elif key in ("flags", "Features"):
            flags.update(value.split())
    memory = _meminfo_bytes(meminfo)
    if "MemTotal" not in memory:
        raise TesselError("/proc/meminfo has no MemTotal line; tessel probe reads Linux's /proc")
    total = memory["MemTotal"]
    available = memory.get("MemAvailable", memory.get("MemFree", total))
    isa = tuple(flag for flag in CPU_ISA_FLAGS if flag in flags)
    return LocalCpu(model, max(cores, 1), isa, total, available)


def _meminfo_bytes(text: str) -> dict[str, int]:
    values = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(\w+):\s+(\d+)\s*kB", line.strip())
        if match:
            values[match.group(1)] = int(match.group(2)) * 1024
    return values


def _read_proc(proc_root: Path, name: str) -> str:
    path = proc_root / name
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise TesselError(
            f"cannot read {path} ({error.strerror or error}); tessel probe reads Linux's /proc: "
            "write the cluster file by hand (docs/planner.md)"
        ) from None


def cluster_data(machine: LocalMachine) -> dict:
    """The machine as a mapping of the cluster-file shape (`tessel.plan.files.cluster.parse_cluster`)."""
    cpu_reserved_gib = get_gpu(CPU_TYPE).reserved_bytes / GIB
    if machine.cpu.memory_gib <= cpu_reserved_gib:
        raise TesselError(
            f"only {machine.cpu.memory_gib:.2f} GiB of DRAM is free (MemAvailable); the CPU device needs "
            f"more than the {cpu_reserved_gib:g} GiB tessel reserves for the OS and Python"
        )
    cpu_node = {
        "name": CPU_NODE,
        "gpus": [{"type": CPU_TYPE, "count": 1, "memory_gib": machine.cpu.memory_gib}],
        "intra_link": "pcie",
    }
    if not machine.gpus:
        return {"name": CLUSTER_NAME, "nodes": [cpu_node]}
    intra = _intra_link(machine.gpus) if machine.topology is None else machine.topology.intra_link()[0]
    gpu_node = {"name": GPU_NODE, "gpus": _gpu_groups(machine.gpus), "intra_link": intra}
    pcie_bytes_per_s = max(get_gpu(gpu.gpu_type).pcie_h2d_bytes_per_s for gpu in machine.gpus)
    network = {"bandwidth_gbps": pcie_bytes_per_s * BITS_PER_BYTE / GB, "latency_us": HOST_LINK_LATENCY_US}
    return {"name": CLUSTER_NAME, "nodes": [gpu_node, cpu_node], "network": network}


def _gpu_groups(gpus: tuple[LocalGpu, ...]) -> list[dict]:
    """Runs of GPUs of one type and memory as {type, count, memory_gib}, in CUDA order."""
    groups: list[dict] = []
    for gpu in gpus:
        if groups and groups[-1]["type"] == gpu.gpu_type and groups[-1]["memory_gib"] == gpu.memory_gib:
            groups[-1]["count"] += 1
        else:
            groups.append({"type": gpu.gpu_type, "count": 1, "memory_gib": gpu.memory_gib})
    return groups


def _intra_link(gpus: tuple[LocalGpu, ...]) -> str:
    """Without a topology: nvlink when every GPU's catalog type has NVLink and none is a PCIe card."""
    nvlink = all(
        get_gpu(gpu.gpu_type).nvlink_bytes_per_s is not None and "PCIE" not in gpu.name.upper()
        for gpu in gpus
    )
    return "nvlink" if nvlink and len(gpus) > 1 else "pcie"


def topology_comments(machine: LocalMachine) -> list[str]:
    """Comment lines on how the GPUs are wired and why intra_link is what it is."""
    topology = machine.topology
    if topology is None:
        return ["# intra_link between GPUs from the catalog types (no topology could be read)"]
    kind, why = topology.intra_link()
    lines = [f"# intra_link {kind} from {topology.source}: {why}"]
    for group in topology.nvlink_groups():
        pairs = [(i, j) for i in group for j in group if i < j and topology.nvlinks(i, j)]
        shown = ", ".join(f"{i}-{j}:NV{topology.nvlinks(i, j)}" for i, j in pairs[:12])
        more = " ..." if len(pairs) > 12 else ""
        lines.append(f"# NVLink group cuda {','.join(map(str, group))}: {shown}{more}")
    if any(machine.nvlink_gbs):
        per_gpu = sorted({f"{gbs:g}" for gbs in machine.nvlink_gbs})
        lines.append(f"# nvidia-smi nvlink --status: {'/'.join(per_gpu)} GB/s of active NVLinks per GPU")
    return lines


def cluster_yaml(machine: LocalMachine) -> str:
    """The cluster file of this machine, what was found and what was assumed in its comments."""
    lines = [
        "# This machine, as `tessel probe` found it (tessel/catalog/local_machine.py).",
        "# The planner uses the catalog's figures for each type's speeds (FLOP/s, memory and PCIe",
        "# bandwidth; tessel/catalog/gpus.yaml); what `tessel probe` measured, if anything, is listed",
        "# at the end for comparison, and `tessel profile` measures a layer on a device.",
    ]
    for gpu in machine.gpus:
        lines.append(
            f"# {GPU_NODE}/gpu{gpu.cuda_index} = cuda:{gpu.cuda_index}: {gpu.name} (nvidia-smi index "
            f"{gpu.smi_index}, {gpu.memory_gib:.2f} GiB) -> catalog {gpu.gpu_type}"
        )
    cpu = machine.cpu
    lines.append(
        f"# {CPU_NODE}/gpu0: {cpu.model_name}, {cpu.logical_cores} logical cores, "
        f"{' '.join(cpu.isa) or 'no listed vector extensions'}; memory_gib is the DRAM free when probed "
        f"(MemAvailable) of {cpu.memory_total_bytes / GIB:.2f} GiB"
    )
    if machine.gpus:
        lines.append(
            "# network: GPU <-> CPU over PCIe at the catalog's achieved host-to-device rate (an assumption);"
        )
        lines += topology_comments(machine)
    lines += [f"# note: {note}" for note in machine.notes]
    return "\n".join(lines) + "\n" + yaml.safe_dump(cluster_data(machine), sort_keys=False)
