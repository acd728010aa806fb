"""Which int8 matmul a CPU runs fast, read from its feature flags.

W8A8 (`choose_int8_path`):

    int_mm     AMX, or AVX-512 VNNI for static activation scales: `torch._int_mm` (oneDNN's int8
               GEMM, int32 accumulation)
    fp16codes  AVX2 without VNNI: the int8 codes of weights and activations through fbgemm's
               fp16-weight GEMM (`tessel.kernels.int8_cpu`): the int32 GEMM's sums below 2**24;
               `torch._int_mm` has no fast kernel there (far slower than fp32)
    fbgemm     fbgemm's int8 GEMM, faster: the default on AVX-512 VNNI (without AMX) for
               dynamic activations, with 8-bit activation codes per token (VNNI's vpdpbusd sums
               u8 x s8 products straight into int32: nothing saturates); on AVX2 the default for
               weights whose codes fit 7 bits (the quantize command's `--weight-code-bits 7`), with 8-bit
               activation codes; opt-in on AVX2 for full-range weights, with 7-bit activation
               codes (AVX2's vpmaddubsw sums pairs into int16; less accurate: docs/quant.md)
    dequant    anything else: the same integer products as float32 GEMMs (exact below 2**24)

`TESSEL_INT8_PATH=int_mm|fp16codes|fbgemm|dequant` forces a path (each one runs on any x86 CPU
with PyTorch's fbgemm; only the speed differs, and `fbgemm`'s codes).

W8A16 (int8 weights, float activations; `choose_w8a16_path`):

    gemv       AVX-512 and a C++ compiler for inductor: a fused int8 GEMV for decode steps of up
               to GEMV_MAX_ROWS rows, the de-quantised float32 GEMM above (float32 activations)
    fp16codes  AVX2 without AVX-512: the int8 codes as float16 in fbgemm's fp16-weight GEMM, the
               scale in float32 (float32 activations, every row count); inductor's int8 GEMV has
               no fast int8 loads there
    bf16       only when forced, on AVX-512 BF16 / AMX: bfloat16 activations and outputs
               (`torch._weight_int8pack_mm`, oneDNN's bf16 GEMM); changes the numerics
    dequant    otherwise: the de-quantised float32 GEMM

`TESSEL_W8A16_PATH=gemv|fp16codes|bf16|dequant` forces one (`bf16` only where the CPU has bf16
dot products).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from tessel.errors import TesselError

INT8_PATHS = ("int_mm", "fp16codes", "fbgemm", "dequant")
ENV_OVERRIDE = "TESSEL_INT8_PATH"
VNNI_FLAGS = frozenset({"avx512_vnni", "amx_int8"})
AMX_INT8_FLAG = "amx_int8"
FBGEMM_NO_SATURATION_FLAG = "avx512_vnni"  # fbgemm's int8 kernels use vpdpbusd (int32 sums) here
CPUINFO = Path("/proc/cpuinfo")

W8A16_PATHS = ("gemv", "fp16codes", "bf16", "dequant")
AVX512_FLAG = "avx512f"
W8A16_ENV_OVERRIDE = "TESSEL_W8A16_PATH"
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


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


@functools.cache
def fbgemm_available() -> bool:
    """Whether this torch build has fbgemm (asked once: the engine list is rebuilt on every query)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def choose_int8_path(
    flags: frozenset[str] | None = None,
    capability: str | None = None,
    weights_fit_7bit: bool = False,
    static_scales: bool = False,
) -> str:
    """The CPU int8 path for these flags (default: this machine's), unless TESSEL_INT8_PATH forces one.
    `weights_fit_7bit`: the weight codes lie in [-64, 63], so fbgemm's int8 GEMM is exact with
    8-bit activations on AVX2 and is taken there instead of `fp16codes`. `static_scales`: the
    activations have a calibrated scale, which fbgemm's dynamic linear cannot take."""
    forced = os.environ.get(ENV_OVERRIDE, "").strip()
    if forced:
        if forced not in INT8_PATHS:
            raise TesselError(f"{ENV_OVERRIDE}={forced!r}; choose one of {', '.join(INT8_PATHS)}")
        return forced
    flags = cpu_flags() if flags is None else flags
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    if flags & VNNI_FLAGS:
        # Zen 4, one SmolLM2 layer's linears at 32 rows: fbgemm faster than oneDNN's _int_mm
        # (measured by benchmarks/kernels.py --only smollm2; docs/results.md).
        # AMX's tiles are oneDNN's alone (not measured here), so AMX CPUs keep _int_mm.
        fbgemm = FBGEMM_NO_SATURATION_FLAG in flags and AMX_INT8_FLAG not in flags
        return "fbgemm" if fbgemm and not static_scales and fbgemm_available() else "int_mm"
    if ("avx2" in flags or capability in ("AVX2", "AVX512")) and fbgemm_available():
        return "fbgemm" if weights_fit_7bit and not static_scales else "fp16codes"
    return "dequant"


def avx512_cpu(flags: frozenset[str] | None = None) -> bool:
    """AVX-512F: where inductor's compiled int8 GEMV (`tessel.kernels.w8a16_cpu`) loads int8 fast."""
    return AVX512_FLAG in (cpu_flags() if flags is None else flags)


def int_mm_fast(flags: frozenset[str] | None = None) -> bool:
    """Whether `torch._int_mm` has a fast CPU kernel here (AVX-512 VNNI or AMX), or is forced."""
    flags = cpu_flags() if flags is None else flags
    return bool(flags & VNNI_FLAGS) or os.environ.get(ENV_OVERRIDE, "").strip() == "int_mm"


def fbgemm_act_bits(weights_fit_7bit: bool, flags: frozenset[str] | None = None) -> int:
    """The activation code bits fbgemm's int8 GEMM takes exactly against these weights: 8 on AVX-512
    VNNI (int32 sums of single products) or for weight codes in [-64, 63]; 7 otherwise, where AVX2's
    int16 pair sums (2 x 255 x 127 > 32767) would saturate."""
    flags = cpu_flags() if flags is None else flags
    return 8 if weights_fit_7bit or FBGEMM_NO_SATURATION_FLAG in flags else 7


def choose_w8a16_path(flags: frozenset[str] | None = None, compiler: bool | None = None) -> str:
    """The CPU W8A16 path (default: this machine's), unless TESSEL_W8A16_PATH forces one."""
    flags = cpu_flags() if flags is None else flags
    forced = os.environ.get(W8A16_ENV_OVERRIDE, "").strip()
    if forced:
        if forced not in W8A16_PATHS:
            raise TesselError(f"{W8A16_ENV_OVERRIDE}={forced!r}; choose one of {', '.join(W8A16_PATHS)}")
        if forced == "bf16" and not flags & BF16_FLAGS:
            raise TesselError(
                f"{W8A16_ENV_OVERRIDE}=bf16 needs a CPU with AVX-512 BF16 or AMX (flags "
                f"{', '.join(sorted(BF16_FLAGS))}); use gemv or dequant"
            )
        return forced
    if not avx512_cpu(flags) and "avx2" in flags and fbgemm_available():
        return "fp16codes"
    if compiler is None:
        from tessel.kernels.cpu_compile import compiler_available

        compiler = compiler_available()
    return "gemv" if compiler else "dequant"


def cpu_summary() -> dict[str, object]:
    """What the benchmark prints beside its figures."""
    flags = cpu_flags()
    interesting = sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    return {
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "flags": interesting,
        "int8_path": choose_int8_path(),
        "int8_path_7bit_weight_codes": choose_int8_path(weights_fit_7bit=True),
        "w8a16_path": choose_w8a16_path(),
        "quantized_engines": list(torch.backends.quantized.supported_engines),
    }
