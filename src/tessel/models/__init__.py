"""Model definitions (the Llama family) and their loading from a local Hugging Face directory."""

from __future__ import annotations

from tessel.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tessel.models.loader import load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "load_model"]
