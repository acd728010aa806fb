"""Triton kernels with PyTorch paths; see `tessel.kernels._dispatch` for how a call picks one.

Public functions are imported lazily (each op lives in its own module), so importing one op
does not compile or import the others.
"""

from __future__ import annotations

import importlib
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
