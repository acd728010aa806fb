"""Triton kernels with PyTorch paths; see `tessel.kernels._dispatch` for how a call picks one.

Public functions are imported lazily (each op lives in its own module), so importing one op
does not compile or import the others.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS = {
    "int8_gemm": "tessel.kernels.int8_gemm",
    "w8a16_gemm": "tessel.kernels.w8a16_gemm",
    "quantize_per_token": "tessel.kernels.quantize",
    "flash_attention": "tessel.kernels.flash_attention",
    "flash_attention_int8": "tessel.kernels.flash_attention",
    "paged_decode_attention": "tessel.kernels.paged_decode",
    "rms_norm": "tessel.kernels.rms_norm",
    "layer_norm": "tessel.kernels.layer_norm",
    "rope": "tessel.kernels.rope",
    "silu_and_mul": "tessel.kernels.silu_and_mul",
    "softmax": "tessel.kernels.softmax",
    "log_softmax": "tessel.kernels.softmax",
    "transpose": "tessel.kernels.transpose",
    "conv2d": "tessel.kernels.conv2d",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tessel.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


class _KernelsPackage(types.ModuleType):
    """Keeps `tessel.kernels.<op>` bound to the function when its module has the same name.

    Importing the submodule `tessel.kernels.rms_norm` makes Python set the package attribute
    `rms_norm` to that submodule, which would shadow the function on every later access
    (`kernels.rms_norm(...)` -> "'module' object is not callable"). The function is bound
    instead; the module itself stays importable (`from tessel.kernels.rms_norm import ...`).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            value = getattr(value, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _KernelsPackage
