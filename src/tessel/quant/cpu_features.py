"""Which int8 matmul a CPU runs fast, read from its feature flags.

    int_mm   AVX-512 VNNI or AMX: `torch._int_mm` (oneDNN's int8 GEMM, int32 accumulation)
    fbgemm   AVX2 without VNNI: PyTorch's fbgemm dynamic int8 linear (`quantized.linear_dynamic`);
             `torch._int_mm` has no fast kernel there (the issue measured 0.04x fp32)
    dequant  anything else: the same integer products as float32 GEMMs (exact below 2**24)

`TESSEL_INT8_PATH=int_mm|fbgemm|dequant` forces a path (each one runs on any x86 CPU with
PyTorch's fbgemm; only the speed differs).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from tessel.errors import TesselError

INT8_PATHS = ("int_mm", "fbgemm", "dequant")
ENV_OVERRIDE = "TESSEL_INT8_PATH"
VNNI_FLAGS = frozenset({"avx512_vnni", "amx_int8"})
CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The `flags` of the first processor in /proc/cpuinfo (empty where there is none)."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def choose_int8_path(flags: frozenset[str] | None = None, capability: str | None = None) -> str:
    """The CPU int8 path for these flags (default: this machine's), unless TESSEL_INT8_PATH forces one."""
    forced = os.environ.get(ENV_OVERRIDE, "").strip()
    if forced:
        if forced not in INT8_PATHS:
            raise TesselError(f"{ENV_OVERRIDE}={forced!r}; choose one of {', '.join(INT8_PATHS)}")
        return forced
    flags = cpu_flags() if flags is None else flags
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    if flags & VNNI_FLAGS:
        return "int_mm"
    if ("avx2" in flags or capability in ("AVX2", "AVX512")) and fbgemm_available():
        return "fbgemm"
    return "dequant"


def describe() -> dict[str, object]:
    """What the benchmark prints beside its figures."""
    flags = cpu_flags()
    interesting = sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    return {
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "flags": interesting,
        "int8_path": choose_int8_path(),
        "quantized_engines": list(torch.backends.quantized.supported_engines),
    }
