"""Choose the Triton kernel or the PyTorch path for a call.

`TESSEL_KERNEL_BACKEND` = `auto` (default) | `triton` | `torch`:
- `auto`: CUDA tensors go to Triton (when Triton imports), everything else to PyTorch;
- `triton`: always Triton. On CPU tensors this needs `TRITON_INTERPRET=1`, which is how the
  tests run the kernels on a machine without a GPU;
- `torch`: always the PyTorch path.
"""

from __future__ import annotations

import functools
import os

import torch

from tessel.errors import TesselError
from tessel.kernels._utils import interpreting, triton

BACKEND_ENV = "TESSEL_KERNEL_BACKEND"
_BACKENDS = ("auto", "triton", "torch")


def requested_backend() -> str:
    # read on every call (tests flip it per test); parsed once per distinct raw value
    return _parse_backend(os.environ.get(BACKEND_ENV, "auto"))


@functools.lru_cache(maxsize=16)
def _parse_backend(raw: str) -> str:
    backend = raw.strip().lower() or "auto"
    if backend not in _BACKENDS:
        raise TesselError(f"{BACKEND_ENV}={backend!r} is not one of {', '.join(_BACKENDS)}")
    return backend


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when this call should run the Triton kernel, False for the PyTorch path."""
    backend = requested_backend()
    if backend == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "triton":
        if triton is None:
            raise TesselError(f"{BACKEND_ENV}=triton but triton is not installed (pip install triton)")
        if not on_cuda and not interpreting():
            raise TesselError(
                f"{BACKEND_ENV}=triton on CPU tensors needs TRITON_INTERPRET=1 "
                "(set it before importing triton)"
            )
        return True
    return on_cuda and triton is not None
