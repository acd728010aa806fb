"""The engine's model config (the Llama family and its relatives), built from the one config.json reader.

`tessel.catalog.hf_config` validates the file (counts, head divisibility, rope scaling, windows,
experts); this module keeps what only the engine needs: the architectures it runs, q/k/v/o biases,
per-layer windows and rope bases, the MLP kind of every layer, EOS ids merged from
generation_config.json, and the dtype to load in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tessel.catalog.hf_arch import LIST_RUNNABLE, RUNNABLE_ARCHITECTURES
from tessel.catalog.hf_config import (
    ARCHITECTURES,
    DEFAULT_ROPE_THETA,
    HFConfig,
    RopeScaling,
    parse_hf_config,
    read_generation_eos,
    read_hf_config,
)
from tessel.dtypes import AUTO, runtime_dtype_name
from tessel.errors import TesselError

# The architectures the engine runs (the reader also reads OPT, for the planner): name -> family.
SUPPORTED_ARCHITECTURES = {name: ARCHITECTURES[name] for name in RUNNABLE_ARCHITECTURES}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLP's activation: SwiGLU, Gemma's GeGLU
TRANSFORMERS_CONFIGS = {"Gemma3ForCausalLM": "Gemma3TextConfig"}  # where the name is not <arch>Config
MAX_REASON_CHARS = 300  # of a third-party error, quoted in a one-line message
TORCH_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def _supported() -> str:
    return f"{', '.join(SUPPORTED_ARCHITECTURES)} (`{LIST_RUNNABLE}`)"


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
    layer_types: tuple[str, ...] = ()  # per layer, full_attention or sliding_attention; () all full
    hidden_act: str = "silu"
    qk_norm: bool = False  # RMSNorm per q and k head before rotary (Qwen3, Gemma 3)
    gemma: bool = False  # (1 + w) norms, a norm after attention and around the MLP, embeddings * sqrt(H)
    local_rope_theta: float | None = None  # the rope base of sliding layers when they have their own
    attn_scale: float | None = None  # q.k scale; None: head_dim ** -0.5
    num_experts: int = 0  # routed experts of an MoE layer (0: dense)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)

    def __post_init__(self) -> None:  # the fields were validated by the reader (from_hf)
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise TesselError(
                f"architecture {self.architecture!r} is not supported; the engine runs {_supported()}"
            )

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer `index` (keys at distance < window), or None: every key."""
        if self.sliding_window is None or not self.layer_types:
            return None
        return self.sliding_window if self.layer_types[index] == "sliding_attention" else None

    @property
    def kv_window(self) -> int | None:
        """The window of a model whose every layer has one (the largest), or None: a query at position
        p never reads keys at or before p - kv_window, so their KV blocks can go (`BlockManager`)."""
        windows = [self.layer_window(i) for i in range(self.num_hidden_layers)]
        return None if not windows or None in windows else max(windows)

    def is_moe_layer(self, index: int) -> bool:
        return index in self.moe_layers

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: HFConfig) -> ModelConfig:
        """The engine's config from a validated config.json (`tessel.catalog.hf_config`)."""
        if hf.architecture not in SUPPORTED_ARCHITECTURES:
            raise TesselError(
                f"{hf.source}: architecture {hf.architecture!r} is not supported; "
                f"the engine runs {_supported()}"
            )
        if hf.hidden_act not in ACTIVATIONS:
            raise TesselError(
                f"{hf.source}: hidden_act {hf.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})"
            )
        qwen2 = hf.family in ("qwen2", "qwen2_moe")
        moe = hf.family in ("mixtral", "qwen2_moe", "qwen3_moe")
        scalar = hf.query_pre_attn_scalar
        return cls(
            architecture=hf.architecture,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=hf.num_key_value_heads,
            head_dim=hf.head_dim,
            max_position_embeddings=hf.max_position_embeddings,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=hf.rope_theta if hf.rope_theta is not None else DEFAULT_ROPE_THETA,
            rope_scaling=hf.rope_scaling,
            tie_word_embeddings=hf.tie_word_embeddings,
            qkv_bias=qwen2 or hf.attention_bias,
            o_bias=hf.attention_bias and not qwen2,
            mlp_bias=hf.mlp_bias,
            bos_token_id=hf.bos_token_id,
            eos_token_ids=list(hf.eos_token_ids),
            checkpoint_dtype=hf.torch_dtype or "float32",
            sliding_window=hf.sliding_window,
            layer_types=hf.layer_types,
            hidden_act=hf.hidden_act,
            qk_norm=hf.qk_norm,
            gemma=hf.family == "gemma3_text",
            local_rope_theta=hf.local_rope_theta,
            attn_scale=None if scalar is None else scalar**-0.5,
            num_experts=hf.num_local_experts if moe else 0,
            num_experts_per_tok=hf.num_experts_per_tok if moe else 0,
            moe_intermediate_size=hf.moe_intermediate_size,
            shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
            norm_topk_prob=hf.norm_topk_prob,
            moe_layers=hf.moe_layers if moe else (),
            fused_checkpoint=hf.family == "phi3",
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        return cls.from_hf(parse_hf_config(d, source=source))

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """The config of a model directory, or of a .gguf file's checkpoint directory (converted once)."""
        path = Path(path)
        if path.suffix.lower() == ".gguf" and path.is_file():
            from tessel.models.gguf import resolve_model_path

            path = resolve_model_path(path)
        if not (path / "config.json").is_file():
            raise TesselError(f"{path} has no config.json; point --model at a Hugging Face model directory")
        config = cls.from_hf(read_hf_config(path))
        _check_with_transformers(path, config.architecture)
        generation = path / "generation_config.json"
        if generation.is_file():  # HF generate stops at these too (Llama 3.1 lists several)
            config.eos_token_ids += [
                e for e in read_generation_eos(generation) if e not in config.eos_token_ids
            ]
        return config


def _check_with_transformers(path: Path, architecture: str) -> None:
    """transformers reads config.json too (every tokenizer, quantize's model): what its config class's
    strict field types refuse (a null `hidden_act`, say) is a user error here, not a traceback later."""
    import transformers

    name = TRANSFORMERS_CONFIGS.get(architecture, architecture.removesuffix("ForCausalLM") + "Config")
    config_class = getattr(transformers, name)
    try:
        config_class.from_pretrained(str(path))
    except Exception as error:  # noqa: BLE001 (whatever the third-party reader raises, the file is at fault)
        reason = "; ".join(line.strip() for line in str(error).splitlines() if line.strip())
        raise TesselError(
            f"{path / 'config.json'}: transformers cannot read it ({type(error).__name__}: "
            f"{reason[:MAX_REASON_CHARS]})"
        ) from None


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_DTYPES.values():
            raise TesselError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    name = runtime_dtype_name(str(dtype))  # the one dtype vocabulary (tessel.dtypes); int8/fp8 refused
    if name == AUTO:
        name = config.checkpoint_dtype.removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise TesselError(
            f"dtype {dtype!r}: the checkpoint's {name!r} is not supported; use float32, bfloat16 or float16"
        )
    return TORCH_DTYPES[name]
