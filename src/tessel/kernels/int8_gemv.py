"""W8A8's one-row integer sums by tessel's own x86 kernels (`native/int8_gemv.cpp`), which stream the
int8 weight near the memory's read bandwidth.

A decode step of one sequence multiplies one row of activation codes by every weight of every
linear: it is bound by the bytes it reads, one per weight. Inductor's compiled GEMV
(`tessel.kernels.w8a16_cpu`) converts each int8 weight to float32 and sums in float32; fbgemm's
GEMM is built for many rows. These kernels multiply int8 by int8 into int32 (AVX-512 VNNI's
vpdpbusd; AVX2's vpmaddubsw) over a weight packed once per layer so a call reads one contiguous
buffer (blocks of 16 rows x 64 columns with VNNI, 8 x 32 with AVX2; `pack`; from 2 MB up on huge
pages, `tessel.kernels.huge_pages`): figures in `benchmarks/int8_gemv.py`.

    sums[0, n] = float32(sum_k codes[0, k] * w[n, k])       exact int32 sums

the int32 GEMM's numbers (`int_mm`, fbgemm's); the float32 sums of the other paths equal them while
every partial sum stays below 2**24. The caller applies `int8_epilogue` as on every path.

The kernel follows the CPU (`choose_gemv_isa`: `vnni` with AVX-512 VNNI, `avx2` with AVX2, else none;
`TESSEL_INT8_GEMV=vnni|avx2|off` forces one, for tests and comparisons). AVX2's kernel multiplies
the codes' magnitudes by sign-flipped weights, so a weight holding -128 (possible in
llm-compressor's checkpoints) cannot take it (`pack` returns None; the layer keeps its GEMM).

The kernels are a PyTorch operator, `torch.ops.tessel.int8_gemv_sums` (C++ source
`native/int8_gemv.cpp`), so the compiled decode graphs call them inside a graph, as any other op
(`LinearForm` "w8a8_rows"). The source is compiled against this torch by the system's C++ compiler
(`$CXX`, else c++, g++ or clang++; about 10 s) the first time a process needs it, into tessel's
cache (`$TESSEL_CACHE_DIR/native`), keyed by the source's hash, the compiler and torch's version,
written under a temporary name then moved into place; later processes load it. Without a
compiler, or when building fails (a warning, once), the layers keep their other paths.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tessel.errors import TesselError
from tessel.kernels import cpu_features, huge_pages, native_build

SOURCE = native_build.NATIVE / "int8_gemv.cpp"
OPERATOR = "tessel::int8_gemv_sums"
ENV_OVERRIDE = "TESSEL_INT8_GEMV"
ISAS = ("vnni", "avx2")
# rows x columns of one packed block, per kernel
BLOCK = {"vnni": (16, 64), "avx2": (8, 32)}
VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512_vnni"})
AVX2_FLAG = "avx2"
NEEDS = {"vnni": VNNI_FLAGS, "avx2": frozenset({AVX2_FLAG})}
UNSIGNED_OFFSET = 128  # VNNI: codes + 128 as unsigned bytes


def choose_gemv_isa(flags: frozenset[str] | None = None) -> str | None:
    """`vnni`, `avx2` or None (no kernel) for this CPU; $TESSEL_INT8_GEMV forces one (`off`: none)."""
    forced = os.environ.get(ENV_OVERRIDE, "").strip().lower()
    if forced:
        if forced == "off":
            return None
        if forced not in ISAS:
            raise TesselError(f"{ENV_OVERRIDE}={forced!r}: choose one of {', '.join(ISAS)} or off")
        if not NEEDS[forced] <= cpu_features.cpu_flags():  # it would stop the process (illegal instruction)
            raise TesselError(f"{ENV_OVERRIDE}={forced}: this CPU lacks {', '.join(sorted(NEEDS[forced]))}")
        return forced
    flags = cpu_features.cpu_flags() if flags is None else flags
    if VNNI_FLAGS <= flags:
        return "vnni"
    return "avx2" if AVX2_FLAG in flags else None


@dataclass(frozen=True, slots=True)
class PackedInt8:
    """An int8 weight [N, K] in the blocked layout of kernel `isa`, and what that kernel needs beside it."""

    isa: str
    packed: torch.Tensor  # int8, blocks of BLOCK[isa], zero padded
    wsum128: torch.Tensor  # vnni: int32 [N padded to 16], 128 * sum_k w[n, k]; avx2: empty
    out_features: int
    in_features: int


def pack(weight: torch.Tensor, isa: str | None = None) -> PackedInt8 | None:
    """`weight` int8 [N, K] (CPU) packed for kernel `isa` (default: `choose_gemv_isa()`); None where no
    kernel takes it: no kernel for this CPU, none built, or AVX2 with a weight code of -128."""
    isa = choose_gemv_isa() if isa is None else isa
    if isa is None or weight.dtype != torch.int8 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if isa == "avx2" and weight.numel() and int(weight.min()) == -128:
        return None
    if not available():
        return None
    n, k = weight.shape
    rows, cols = BLOCK[isa]
    n_pad, k_pad = -(-n // rows) * rows, -(-k // cols) * cols
    padded = torch.zeros(n_pad, k_pad, dtype=torch.int8)
    padded[:n, :k] = weight
    blocks = huge_pages.empty(n_pad * k_pad).view(n_pad // rows, k_pad // cols, rows, cols)
    blocks.copy_(padded.view(n_pad // rows, rows, k_pad // cols, cols).permute(0, 2, 1, 3))
    wsum = torch.zeros(0, dtype=torch.int32)
    if isa == "vnni":
        wsum = (padded.sum(dim=1, dtype=torch.int32) * UNSIGNED_OFFSET).contiguous()
    return PackedInt8(isa, blocks, wsum, n, k)


def gemv_sums(codes: torch.Tensor, weight: PackedInt8) -> torch.Tensor:
    """codes float32 [1, K] (integers in [-127, 127]) @ the packed weight.T -> the exact integer sums
    as float32 [1, N]."""
    if codes.shape != (1, weight.in_features) or codes.dtype != torch.float32:
        got = f"{codes.dtype} {tuple(codes.shape)}"
        raise TesselError(f"the int8 GEMV takes float32 codes [1, {weight.in_features}]; got {got}")
    return torch.ops.tessel.int8_gemv_sums(
        codes.contiguous(), weight.packed, weight.wsum128, weight.out_features
    )


def _registered() -> bool:
    """Whether this process has the operator already (loaded once; a second load would clash)."""
    return hasattr(torch.ops.tessel, "int8_gemv_sums")


@functools.cache
def available() -> bool:
    """Whether the operator is loaded (built on first use); False without a compiler or when building
    or loading fails (a warning says why, once per process)."""
    if _registered():
        return True
    if not native_build.load(build, "the int8 GEMV failed; W8A8 keeps its GEMM"):
        return False
    torch.library.register_fake(OPERATOR)(_fake_sums)
    return True


def _fake_sums(codes: torch.Tensor, packed: torch.Tensor, wsum128: torch.Tensor, n: int) -> torch.Tensor:
    """The operator's output without running it (what tracing a graph needs)."""
    return codes.new_empty(1, n)


def build(compiler: str) -> Path:
    """The operator's shared library in tessel's cache, compiled if not there (`native_build.build`)."""
    return native_build.build("int8_gemv", [SOURCE], compiler)
