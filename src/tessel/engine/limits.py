"""The ranges of the engine's sized settings and their one check, torch-free: the CLI shows and checks
them before a model loads, `tessel launch` before a stage process starts, and `EngineConfig` for the
Python API.
"""

from __future__ import annotations

import math

from tessel.errors import TesselError
from tessel.plan.files.plan_parts import MIN_EMULATE_HOST_GBPS

# A KV pool (device or host) of at least about a KiB: one 4-token block of the tests' 2-layer toy
# model (1 KiB in fp32); a real model's block is tens of KiB or more, and the engine refuses a pool that
# holds none. Below it, and at 0, nothing fits.
MIN_KV_CACHE_GIB = 1e-6
# The CLI's bound: a TiB is more than any one machine frees for KV; the engine then checks what is free.
MAX_KV_CACHE_GIB = 1024.0
# torch threads per process: more than any machine's cores (torch.set_num_threads overflows past 2**63)
MAX_TORCH_THREADS = 4096


def _finite_at_least(value: object, floor: float) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value) and value >= floor


def check_kv_cache_gib(value: float | None, name: str) -> float | None:
    """None, or a pool size in GiB of at least MIN_KV_CACHE_GIB (finite)."""
    if value is not None and not _finite_at_least(value, MIN_KV_CACHE_GIB):
        raise TesselError(
            f"{name} must be a finite number of GiB >= {MIN_KV_CACHE_GIB:g} (about a KiB: less holds no "
            f"KV block), got {value!r}"
        )
    return None if value is None else float(value)


def check_emulate_host_gbps(value: float | None, name: str) -> float | None:
    """None, or an emulated host link in Gbit/s (as every bandwidth in tessel) of at least
    MIN_EMULATE_HOST_GBPS (finite): a slower one makes every KV copy wait for hours."""
    if value is not None and not _finite_at_least(value, MIN_EMULATE_HOST_GBPS):
        raise TesselError(
            f"{name} must be a finite bandwidth >= {MIN_EMULATE_HOST_GBPS:g} Gbit/s (slower, each KV copy "
            f"waits for hours), got {value!r}"
        )
    return None if value is None else float(value)
