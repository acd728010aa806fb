"""The model config tessel reads from a Hugging Face `config.json` (Llama / Qwen2 / Mistral)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessel.errors import TesselError
from tessel.layers.rotary import RopeScaling

# HF architecture name -> model_type; model_type is the fallback when `architectures` is missing.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def _supported() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    checkpoint_dtype: str = "float32"
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise TesselError(
                f"architecture {self.architecture!r} is not supported; tessel runs {_supported()}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise TesselError(f"config.json: {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads <= 0 or self.num_key_value_heads <= 0:
            raise TesselError("config.json: num_attention_heads and num_key_value_heads must be > 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise TesselError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        arch = _architecture(d)
        if d.get("hidden_act", "silu") != "silu":
            raise TesselError(f"config.json: hidden_act {d['hidden_act']!r} is not supported (only silu)")
        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        theta, scaling = _rope(d)
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        attention_bias = bool(d.get("attention_bias", False))
        qwen2 = SUPPORTED_ARCHITECTURES[arch] == "qwen2"
        window = d.get("sliding_window") if (not qwen2 or d.get("use_sliding_window")) else None
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            sliding_window=int(window) if window else None,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise TesselError(f"{path} has no config.json; point --model at a Hugging Face model directory")
        try:
            config = cls.from_dict(json.loads(config_file.read_text()))
        except (KeyError, TypeError, ValueError) as error:
            raise TesselError(f"{config_file} is missing or has a bad field: {error}") from error
        generation = path / "generation_config.json"
        if generation.is_file():  # HF generate stops at these too (Llama 3.1 lists several)
            eos = json.loads(generation.read_text()).get("eos_token_id")
            for e in [] if eos is None else (eos if isinstance(eos, list) else [eos]):
                if int(e) not in config.eos_token_ids:
                    config.eos_token_ids.append(int(e))
        return config


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    if archs:
        raise TesselError(f"architecture {archs[0]!r} is not supported; tessel runs {_supported()}")
    by_type = {model_type: arch for arch, model_type in SUPPORTED_ARCHITECTURES.items()}
    model_type = d.get("model_type")
    if model_type in by_type:
        return by_type[model_type]
    raise TesselError(
        f"config.json names no architecture tessel knows ({model_type!r}); supported: {_supported()}"
    )


def _rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either transformers 5 `rope_parameters` or 4.x `rope_scaling`."""
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return theta, None
    names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    kwargs = {name: merged[name] for name in names if merged.get(name) is not None}
    return theta, RopeScaling(rope_type=rope_type, **kwargs)


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise TesselError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        name = config.checkpoint_dtype.removeprefix("torch.")
    if name not in DTYPES:
        raise TesselError(f"dtype {dtype!r} is not supported; use float32, bfloat16, float16 or auto")
    return DTYPES[name]
