"""PyTorch modules built on `tessel.kernels` (imported lazily: one module per layer kind)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Linear": "tessel.layers.linear",
    "W8A8Linear": "tessel.layers.linear",
    "W8A16Linear": "tessel.layers.linear",
    "Conv2d": "tessel.layers.conv",
    "RMSNorm": "tessel.layers.norm",
    "RotaryEmbedding": "tessel.layers.rotary",
    "Attention": "tessel.layers.attention",
    "AttentionMetadata": "tessel.layers.attention",
    "SiluAndMul": "tessel.layers.activation",
    "Sampler": "tessel.layers.sampler",
    "VocabEmbedding": "tessel.layers.embedding",
    "LMHead": "tessel.layers.embedding",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tessel.layers' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
