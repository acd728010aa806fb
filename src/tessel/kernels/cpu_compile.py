"""Static-shape CPU kernels compiled by inductor's C++ codegen, shared by the CPU paths.

`compile_graph(fn, inputs)` traces `fn` on example inputs (`make_fx`) and hands the graph to
`torch._inductor.compile`, without torch.compile's dynamo front end, whose guard checks cost tens
of microseconds a call, as much as a one-row decode step's small kernels. A static shape (one per
compiled kernel) also ran faster than a dynamic-shape one. Nothing then checks the inputs, so a
caller passes only contiguous tensors of exactly the traced shapes and dtypes.

`run(build, args, what, fallback)` calls the kernel `build()` returns (a cached compile) on
`args`; when compiling or running fails it warns once, naming `what` failed and the `fallback`
used instead, returns None, and no kernel compiles again in this process. Compile time is paid
once per shape and process (inductor caches the generated code on disk across processes).
"""

from __future__ import annotations

import functools
import shutil
import warnings
from collections.abc import Callable

import torch


class _State:
    broken: str | None = None  # why compiling failed in this process (then nothing compiles again)


@functools.cache
def _has_cxx() -> bool:
    return any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))


def compiler_available() -> bool:
    """Whether inductor can build C++ kernels here (a C++ compiler on PATH, compiling not broken)."""
    return _State.broken is None and _has_cxx()


def compile_graph(fn: Callable, inputs: list[torch.Tensor]) -> Callable:
    """`fn` traced on `inputs` and compiled for exactly their shapes and dtypes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        return torch._inductor.compile(make_fx(fn)(*inputs), inputs)


def run(build: Callable[[], Callable], args: list[torch.Tensor], what: str, fallback: str):
    """`build()(*args)`; None when compiling or running fails (a warning, once per process)."""
    try:
        return build()(*args)
    except Exception as error:  # inductor raises many types (missing headers, a compiler error, ...)
        _State.broken = f"{type(error).__name__}: {error}"
        warnings.warn(f"tessel: {what} failed ({_State.broken}); using {fallback}", stacklevel=3)
        return None
