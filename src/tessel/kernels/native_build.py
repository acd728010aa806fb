"""tessel's C++ operators (`tessel/kernels/native/*.cpp`) compiled against this torch by the system's
C++ compiler the first time a process needs them, into tessel's cache (`$TESSEL_CACHE_DIR/native`).

A library is keyed by its sources (with the headers beside them), its flags, the compiler, torch's
version and, for a library built for this machine's CPU (`-march=native`), the CPU's flags: a cache
shared by machines never hands one a library another CPU built. `$TESSEL_NATIVE_ARCH=x86-64-v3`
builds them for AVX2-only CPUs instead (`arch_flag`): their code, run on this one. A library is
written under a temporary name then moved into place, so a process that loads it never sees a
half-written file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from tessel.errors import TesselError
from tessel.kernels import cpu_features
from tessel.kernels.autotune import cache_dir

NATIVE = Path(__file__).parent / "native"
NATIVE_ARCH = "-march=native"
ARCH_OVERRIDE = "TESSEL_NATIVE_ARCH"
# x86-64-v3: what an AVX2-only CPU runs (AVX2, FMA, F16C), a stand-in for one on a newer CPU
ARCH_NEEDS = {"native": frozenset(), "x86-64-v3": frozenset({"avx2", "fma", "f16c"})}


def cxx_compiler() -> str | None:
    """$CXX, else the first of c++, g++, clang++ on PATH."""
    forced = os.environ.get("CXX", "").strip()
    if forced:
        return forced if shutil.which(forced.split()[0]) else None
    return next((cc for cc in ("c++", "g++", "clang++") if shutil.which(cc)), None)


def arch_flag(flags: frozenset[str] | None = None) -> str:
    """The -march of the libraries built for a CPU: this machine's (`native`, the default), or
    $TESSEL_NATIVE_ARCH=x86-64-v3 (AVX2's instructions only, to run an AVX2-only CPU's code here),
    refused where this CPU cannot run it."""
    arch = os.environ.get(ARCH_OVERRIDE, "native").strip() or "native"
    if arch not in ARCH_NEEDS:
        raise TesselError(f"{ARCH_OVERRIDE}={arch!r}: choose one of {', '.join(ARCH_NEEDS)}")
    missing = ARCH_NEEDS[arch] - (cpu_features.cpu_flags() if flags is None else flags)
    if missing:
        raise TesselError(f"{ARCH_OVERRIDE}={arch}: this CPU lacks {', '.join(sorted(missing))}")
    return f"-march={arch}"


def library_key(sources: list[Path], compiler: str, flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    headers = sorted(NATIVE.glob("*.h"))
    for part in [*sources, *headers]:
        digest.update(part.read_bytes())
    digest.update(" ".join((compiler, *flags, torch.__version__)).encode())
    if NATIVE_ARCH in flags:
        digest.update(" ".join(sorted(cpu_features.cpu_flags())).encode())
    return digest.hexdigest()[:16]


def build(name: str, sources: list[Path], compiler: str, flags: tuple[str, ...] = ()) -> Path:
    """The shared library `name` of `sources` in tessel's cache, compiled if not there; raises
    `subprocess.CalledProcessError` (its stderr the compiler's) when compiling fails."""
    from torch.utils import cpp_extension

    target = cache_dir() / "native" / f"{name}-{library_key(sources, compiler, flags)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [flag for path in cpp_extension.include_paths() for flag in ("-I", path)]
    libraries = [flag for path in cpp_extension.library_paths() for flag in ("-L", path)]
    command = [*compiler.split(), "-O3", *flags, "-shared", "-fPIC", "-std=c++17", "-w", abi, *includes,
               *map(str, sources), "-o", staging, *libraries, "-lc10", "-ltorch_cpu"]  # fmt: skip
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(staging, target)  # another process building it at once writes the same bytes
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target


def load(build_library: Callable[[str], Path], failure: str) -> bool:
    """Build (if not in the cache) and load an operator library; False without a compiler, or when
    building or loading fails: a warning, "tessel: building {failure} ...", says why."""
    compiler = cxx_compiler()
    if compiler is None:
        return False
    try:
        torch.ops.load_library(str(build_library(compiler)))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or error
        warnings.warn(f"tessel: building {failure} ({detail})", stacklevel=3)
        return False
    return True
