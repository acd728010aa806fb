"""tessel's whole one-row decode step as one C++ call (`native/decode_row.cpp`, the operator
`torch.ops.tessel.decode_row`): one sequence's token through every plain Llama layer a model holds,
W8A8 with dynamic activations whose linears take tessel's int8 GEMV (`tessel.kernels.int8_gemv`).

The compiled graphs of `tessel.engine.cpu_graph` run the same formulas as two graphs a layer, each
called from Python; at one row those calls and the small kernels between the GEMVs cost about as
much as reading the weights (`benchmarks/decode_profile.py`). This operator does a layer's norms,
codes, GEMVs, rotary, cache write, attention and SiLU in one pass over float32 rows: figures in
`benchmarks/int8_gemv.py --only engine`.

Built for this machine's CPU (`-march=native`, keyed by its flags; `TESSEL_NATIVE_ARCH=x86-64-v3`:
for an AVX2-only one) the first time a process needs it, as the GEMV is
(`tessel.kernels.native_build`); without a compiler, or when building fails (a warning, once), the
step keeps its graphs. `TESSEL_DECODE_ROW=off` keeps them too (comparisons).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from tessel.errors import TesselError
from tessel.kernels import native_build

SOURCE = native_build.NATIVE / "decode_row.cpp"
ENV_OVERRIDE = "TESSEL_DECODE_ROW"


def enabled() -> bool:
    """Whether the one-row step may take the operator ($TESSEL_DECODE_ROW: `on`, the default, or `off`)."""
    value = os.environ.get(ENV_OVERRIDE, "on").strip().lower() or "on"
    if value not in ("on", "off"):
        raise TesselError(f"{ENV_OVERRIDE}={value!r}: choose on or off")
    return value == "on"


def _registered() -> bool:
    return hasattr(torch.ops.tessel, "decode_row")


@functools.cache
def available() -> bool:
    """Whether the operator is loaded (built on first use); False without a compiler or when building
    or loading fails (a warning says why, once per process)."""
    if _registered():
        return True
    return native_build.load(build, "the one-row decode step failed; it keeps its compiled graphs")


def flags() -> tuple[str, ...]:
    """The compiler's flags: this CPU's instructions ($TESSEL_NATIVE_ARCH), loops vectorised."""
    return (native_build.arch_flag(), "-fopenmp-simd")


def build(compiler: str) -> Path:
    """The operator's shared library in tessel's cache, compiled if not there."""
    return native_build.build("decode_row", [SOURCE], compiler, flags())
