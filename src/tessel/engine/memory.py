"""How much memory the machine can give the KV cache, so an impossible `kv_cache_gib` fails at once.

On CUDA the free device memory (`torch.cuda.mem_get_info`); on CPU `MemAvailable` from
/proc/meminfo (Linux), the kernel's estimate of memory available without swapping. Where neither
can be read the check is skipped rather than guessed.
"""

from __future__ import annotations

from pathlib import Path

from tessel.errors import TesselError

MEMINFO = Path("/proc/meminfo")


def available_memory_bytes(device: str = "cpu") -> int | None:
    """Free bytes on `device` ("cpu" or a CUDA device), or None where the system does not say."""
    if device.startswith("cuda"):
        import torch

        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes)
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_kv_cache_fits(kv_cache_gib: float, device: str = "cpu") -> None:
    """Raise a TesselError naming both numbers when `kv_cache_gib` exceeds the available memory."""
    available = available_memory_bytes(device)
    if available is not None and kv_cache_gib * 2**30 > available:
        raise TesselError(
            f"kv_cache_gib={kv_cache_gib:g} asks for more memory than {device} has available "
            f"({available / 2**30:.2f} GiB); lower --kv-cache-gib"
        )


def check_host_kv_cache_fits(host_kv_cache_gib: float) -> None:
    """Raise a TesselError when the host KV pool (`host_kv_cache_gib`) exceeds the host's available
    memory."""
    available = available_memory_bytes("cpu")
    if available is not None and host_kv_cache_gib * 2**30 > available:
        raise TesselError(
            f"host_kv_cache_gib={host_kv_cache_gib:g} asks for more host memory than is available "
            f"({available / 2**30:.2f} GiB); lower --host-kv-cache-gib or use --preemption-mode recompute"
        )
