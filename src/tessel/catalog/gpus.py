"""GPU specs from the bundled catalog (`gpus.yaml`, every figure with its datasheet next to it).

spec = get_gpu("a100-80g")       # names are case-insensitive
spec.peak_flops_per_s["fp16"]    # dense tensor-core FLOP/s
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources

import yaml

from tessel.dtypes import PLAN_DTYPES
from tessel.errors import TesselError
from tessel.units import GIB

DTYPES = PLAN_DTYPES  # the precisions every GPU has a peak for: what the planner offers for weights
GB = 1e9
TERA = 1e12
# Achieved pinned host <-> device copies per PCIe generation, x16, GB/s per direction: ~80% of the raw
# rate (PCI-SIG base specifications: 3.0 15.75, 4.0 31.5, 5.0 63 GB/s), as gpus.yaml's header says.
PCIE_GEN_ACHIEVED_GBS = {3: 12.0, 4: 25.0, 5: 50.0}


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One device type. Bandwidths in bytes/s (per direction), FLOP/s dense (no 2:4 sparsity)."""

    name: str
    memory_bytes: int
    peak_flops_per_s: dict[str, float] = field(hash=False)  # one per DTYPES
    mem_bandwidth_bytes_per_s: float
    pcie_h2d_bytes_per_s: float
    pcie_d2h_bytes_per_s: float
    nvlink_bytes_per_s: float | None  # per direction to NVLink peers; None when the GPU has none
    reserved_bytes: int  # CUDA context, library workspaces: not usable for tensors
    sources: tuple[str, ...]
    emulate_speed: float = 1.0  # < 1: this device emulated at that fraction of its own speed

    @property
    def base_name(self) -> str:
        """The catalog name of the device underneath an emulated one (profiles are keyed by it)."""
        return self.name.split("@", 1)[0]

    def __post_init__(self) -> None:
        missing = [dtype for dtype in DTYPES if dtype not in self.peak_flops_per_s]
        if missing:
            raise ValueError(f"GPU {self.name}: peak_flops_per_s lacks {missing}")
        if self.memory_bytes <= self.reserved_bytes:
            raise ValueError(f"GPU {self.name}: reserved_bytes must be below memory_bytes")
        rates = [self.mem_bandwidth_bytes_per_s, self.pcie_h2d_bytes_per_s, self.pcie_d2h_bytes_per_s]
        if min(rates + list(self.peak_flops_per_s.values())) <= 0:
            raise ValueError(f"GPU {self.name}: bandwidths and peak FLOP/s must be positive")

    @property
    def usable_bytes(self) -> int:
        """Memory left for weights, KV cache and activations."""
        return self.memory_bytes - self.reserved_bytes

    def emulated(self, speed: float) -> GpuSpec:
        """This device run at `speed` (0 < speed <= 1) of its speed: peak FLOP/s and memory bandwidth
        scaled (a cluster's `emulate: {speed}`, for running uneven plans on one host)."""
        if speed == 1.0:
            return self
        if not 0.0 < speed <= 1.0:
            raise TesselError(f"emulate speed must be in (0, 1], got {speed}")
        speed *= self.emulate_speed
        return replace(
            self,
            name=f"{self.base_name}@{speed:g}x",
            emulate_speed=speed,
            peak_flops_per_s={dtype: flops * speed for dtype, flops in self.peak_flops_per_s.items()},
            mem_bandwidth_bytes_per_s=self.mem_bandwidth_bytes_per_s * speed,
        )

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops_per_s:
            raise TesselError(
                f"the GPU catalog has no peak FLOP/s for dtype {dtype!r}; use one of {', '.join(DTYPES)}"
            )
        return self.peak_flops_per_s[dtype]


@cache
def _catalog() -> dict[str, GpuSpec]:
    text = resources.files("tessel.catalog").joinpath("gpus.yaml").read_text()
    return {name.lower(): _spec_from_entry(name, entry) for name, entry in yaml.safe_load(text).items()}


def _spec_from_entry(name: str, entry: dict) -> GpuSpec:
    nvlink = entry.get("nvlink_gbs")
    return GpuSpec(
        name=name,
        memory_bytes=int(entry["memory_gib"] * GIB),
        peak_flops_per_s={dtype: float(entry["peak_tflops"][dtype]) * TERA for dtype in DTYPES},
        mem_bandwidth_bytes_per_s=float(entry["mem_bandwidth_gbs"]) * GB,
        pcie_h2d_bytes_per_s=float(entry["pcie_h2d_gbs"]) * GB,
        pcie_d2h_bytes_per_s=float(entry["pcie_d2h_gbs"]) * GB,
        nvlink_bytes_per_s=None if nvlink is None else float(nvlink) * GB,
        reserved_bytes=int(entry["reserved_gib"] * GIB),
        sources=tuple(entry["sources"]),
    )


def with_host_link(
    spec: GpuSpec, pcie_gen: int | None, measured_bytes_per_s: tuple[float, float] | None = None
) -> GpuSpec:
    """`spec` with its host link: measured (h2d, d2h) bytes/s when given, else the catalog's figures
    capped at what PCIe generation `pcie_gen` achieves (None: the catalog's)."""
    if measured_bytes_per_s is not None:
        h2d, d2h = measured_bytes_per_s
    elif pcie_gen is not None:
        if pcie_gen not in PCIE_GEN_ACHIEVED_GBS:
            known = sorted(PCIE_GEN_ACHIEVED_GBS)
            raise TesselError(f"unknown PCIe generation {pcie_gen}; use one of {known}")
        cap = PCIE_GEN_ACHIEVED_GBS[pcie_gen] * GB
        h2d, d2h = min(spec.pcie_h2d_bytes_per_s, cap), min(spec.pcie_d2h_bytes_per_s, cap)
    else:
        return spec
    return replace(spec, pcie_h2d_bytes_per_s=h2d, pcie_d2h_bytes_per_s=d2h)


def known_gpus() -> list[str]:
    """Catalog names in their canonical spelling, e.g. ["T4", "L4", ..., "cpu"]."""
    return [spec.name for spec in _catalog().values()]


def get_gpu(name: str) -> GpuSpec:
    """The spec of a GPU type by name (case-insensitive); unknown names list the known ones."""
    spec = _catalog().get(str(name).strip().lower())
    if spec is None:
        raise TesselError(f"unknown GPU type {name!r}; known types: {', '.join(known_gpus())}")
    return spec
