"""Transfer times: links between devices, and host (DRAM) <-> device copies over a GPU's PCIe.

A link costs `latency + bytes / bandwidth`; sending nothing costs nothing. A host transfer uses
the GPU's own PCIe bandwidth in that direction (`GpuSpec.pcie_h2d_bytes_per_s` /
`pcie_d2h_bytes_per_s`), which the catalog records separately because they differ (FlexGen
measured 12.9 GB/s host-to-GPU but under 1 GB/s GPU-to-host for KV on a T4).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.catalog.gpus import GpuSpec


@dataclass(frozen=True, slots=True)
class LinkSpec:
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0 or self.latency_s < 0:
            raise ValueError(f"a link needs positive bandwidth and non-negative latency, got {self}")


def link_time_s(link: LinkSpec, n_bytes: float) -> float:
    """latency + bytes / bandwidth; 0 when nothing is sent."""
    if n_bytes <= 0:
        return 0.0
    return link.latency_s + n_bytes / link.bandwidth_bytes_per_s


def host_to_device_time_s(gpu: GpuSpec, n_bytes: float) -> float:
    return max(n_bytes, 0.0) / gpu.pcie_h2d_bytes_per_s


def device_to_host_time_s(gpu: GpuSpec, n_bytes: float) -> float:
    return max(n_bytes, 0.0) / gpu.pcie_d2h_bytes_per_s
