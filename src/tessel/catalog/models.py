"""Model shapes: presets copied from the real Hugging Face `config.json` files, or any local one.

    model = load_model("llama-3-70b")                 # a preset (case-insensitive)
    model = load_model("/models/Llama-3.1-8B")        # a directory holding config.json
    model = load_model("/models/x/config.json")       # or the file itself

Llama, Mistral, Qwen2 and Mixtral configs use the same field names (`hidden_size`,
`num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `intermediate_size`, ...);
OPT uses `ffn_dim`, LayerNorm with bias, biased projections and learned positions.

Mixtral, Qwen2-MoE and Qwen3-MoE price their experts as they run: each layer holds all
`num_experts` expert MLPs of `moe_intermediate_size` (memory) but a token runs through
`experts_per_token` of them, plus Qwen2-MoE's shared expert (compute); the cost model counts both
that way. Qwen3 and Gemma 3 add q/k norm weights; Gemma 3's extra norms are not counted (2h per layer).

BERT (`BertModel`, `BertForMaskedLM`, ...: sentence-transformers' encoders) is an encoder
(`encoder=True`): post-norm layers of bidirectional attention, a GELU MLP (fc1/fc2 with biases)
and LayerNorms; learned absolute positions and token types on the first stage; no KV cache, no
decode, no LM head: one forward per request, whose hidden states are pooled into an embedding.
Its config.json is read by `tessel.catalog.bert_config` (the engine's loader reads it there too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tessel.catalog.bert_config import BertConfig, encoder_architecture
from tessel.catalog.hf_config import HFConfig, config_path, parse_hf_config, read_hf_config, read_json_object
from tessel.errors import TesselError

MLP_KINDS = ("gated", "plain")  # gated: gate/up/down with SiLU (Llama); plain: fc1/fc2 with ReLU (OPT)
NORM_KINDS = ("rmsnorm", "layernorm")
ATTENTION_BIAS = ("none", "qkv", "all")  # Qwen2 biases q/k/v only; OPT biases all four projections
MAX_CONFIG_INT = 2**40  # bound on any count in a config.json (sizes, layers, vocabulary), far above real ones
OPT_POSITION_OFFSET = 2  # OPTLearnedPositionalEmbedding holds max_position_embeddings + 2 rows (HF source)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    architecture: str  # HF `architectures[0]`, e.g. "LlamaForCausalLM"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # FFN width of one (expert) MLP
    vocab_size: int
    tied_embeddings: bool
    max_position_embeddings: int
    mlp_kind: str = "gated"
    norm_kind: str = "rmsnorm"
    attention_bias: str = "none"
    mlp_bias: bool = False
    num_experts: int = 1  # MoE experts held per layer (1 = dense)
    experts_per_token: int = 1  # experts each token runs through
    shared_expert_intermediate_size: int = 0  # an expert every token runs too (Qwen2-MoE); 0: none
    qk_norm: bool = False  # RMSNorm weights per q and k head (Qwen3, Gemma 3)
    learned_position_rows: int = 0  # rows of a learned position table on the first stage (OPT)
    rope_theta: float | None = None
    source: str = ""  # where the numbers come from (HF repo or file path)
    encoder: bool = False  # BERT: bidirectional attention, one forward per request, no KV cache

    def __post_init__(self) -> None:
        positive = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim")
        positive += ("intermediate_size", "vocab_size", "num_experts", "experts_per_token")
        for field_name in positive:
            if getattr(self, field_name) <= 0:
                raise ValueError(f"model {self.name}: {field_name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_heads must be a multiple of num_kv_heads")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"model {self.name}: experts_per_token exceeds num_experts")
        if self.mlp_kind not in MLP_KINDS or self.norm_kind not in NORM_KINDS:
            raise ValueError(f"model {self.name}: mlp_kind in {MLP_KINDS}, norm_kind in {NORM_KINDS}")
        if self.attention_bias not in ATTENTION_BIAS:
            raise ValueError(f"model {self.name}: attention_bias must be one of {ATTENTION_BIAS}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1


# Preset configs: the fields of each model's config.json on the Hugging Face Hub, verbatim.
_LLAMA2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000}
_LLAMA2 |= {"max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "tie_word_embeddings": False}
_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256}
_LLAMA3 |= {"rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False}
_LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def _shape(*, hidden: int, intermediate: int, heads: int, layers: int, kv_heads: int) -> dict:
    """A decoder's size fields of config.json, in its order."""
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
    }


_L8B = _shape(hidden=4096, intermediate=14336, heads=32, layers=32, kv_heads=8)
_L70B = _shape(hidden=8192, intermediate=28672, heads=64, layers=80, kv_heads=8)
_QWEN25 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064}
_QWEN25 |= {"max_position_embeddings": 131072, "rope_theta": 1000000.0, "tie_word_embeddings": False}
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936}
_QWEN3 |= {"head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0}
_QWEN3 |= {"tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None}
_OPT = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "vocab_size": 50272}
_OPT |= {"max_position_embeddings": 2048, "do_layer_norm_before": True, "activation_function": "relu"}
_OPT |= {"enable_bias": True, "tie_word_embeddings": True}

_BERT = {"attention_probs_dropout_prob": 0.1, "gradient_checkpointing": False, "hidden_act": "gelu"}
_BERT |= {"hidden_dropout_prob": 0.1, "initializer_range": 0.02, "layer_norm_eps": 1e-12}
_BERT |= {"model_type": "bert"}
_BERT |= {"max_position_embeddings": 512, "num_attention_heads": 12, "pad_token_id": 0}
_BERT |= {"position_embedding_type": "absolute", "type_vocab_size": 2, "use_cache": True, "vocab_size": 30522}

PRESETS: dict[str, tuple[str, dict]] = {
    # name: (Hugging Face repo the config.json comes from, its fields)
    "llama-2-7b": (
        "meta-llama/Llama-2-7b-hf",
        _LLAMA2 | _shape(hidden=4096, intermediate=11008, heads=32, layers=32, kv_heads=32),
    ),
    "llama-2-13b": (
        "meta-llama/Llama-2-13b-hf",
        _LLAMA2 | _shape(hidden=5120, intermediate=13824, heads=40, layers=40, kv_heads=40),
    ),
    "llama-2-70b": (
        "meta-llama/Llama-2-70b-hf",
        _LLAMA2 | _L70B,
    ),
    "llama-3-8b": ("meta-llama/Meta-Llama-3-8B", _LLAMA3 | _L8B | {"max_position_embeddings": 8192}),
    "llama-3-70b": ("meta-llama/Meta-Llama-3-70B", _LLAMA3 | _L70B | {"max_position_embeddings": 8192}),
    "llama-3.1-8b": (
        "meta-llama/Llama-3.1-8B",
        _LLAMA3 | _L8B | {"max_position_embeddings": 131072, "rope_scaling": _LLAMA31_ROPE},
    ),
    "llama-3.1-70b": (
        "meta-llama/Llama-3.1-70B",
        _LLAMA3 | _L70B | {"max_position_embeddings": 131072, "rope_scaling": _LLAMA31_ROPE},
    ),
    "qwen2.5-7b": (
        "Qwen/Qwen2.5-7B",
        _QWEN25
        | _shape(hidden=3584, intermediate=18944, heads=28, layers=28, kv_heads=4)
        | {"rms_norm_eps": 1e-06},
    ),
    "qwen2.5-72b": (
        "Qwen/Qwen2.5-72B",
        _QWEN25
        | _shape(hidden=8192, intermediate=29568, heads=64, layers=80, kv_heads=8)
        | {"rms_norm_eps": 1e-05},
    ),
    "mistral-7b": (
        "mistralai/Mistral-7B-v0.1",
        {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000}
        | _L8B
        | {"max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 10000.0}
        | {"sliding_window": 4096, "tie_word_embeddings": False},
    ),
    "mixtral-8x7b": (
        "mistralai/Mixtral-8x7B-v0.1",
        {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000}
        | _L8B
        | {"max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0}
        | {"num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    ),
    "mixtral-8x22b": (
        "mistralai/Mixtral-8x22B-v0.1",
        {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000}
        | _shape(hidden=6144, intermediate=16384, heads=48, layers=56, kv_heads=8)
        | {"max_position_embeddings": 65536, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0}
        | {"num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    ),
    "llama-3.1-405b": (
        "meta-llama/Llama-3.1-405B",
        _LLAMA3
        | _shape(hidden=16384, intermediate=53248, heads=128, layers=126, kv_heads=8)
        | {"max_position_embeddings": 131072, "rope_scaling": _LLAMA31_ROPE},
    ),
    "qwen3-32b": (
        "Qwen/Qwen3-32B",
        _QWEN3
        | _shape(hidden=5120, intermediate=25600, heads=64, layers=64, kv_heads=8)
        | {"max_window_layers": 64},
    ),
    "qwen3-30b-a3b": (
        "Qwen/Qwen3-30B-A3B",
        {**_QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
        | _shape(hidden=2048, intermediate=6144, heads=32, layers=48, kv_heads=4)
        | {"max_window_layers": 48, "decoder_sparse_step": 1, "mlp_only_layers": []}
        | {
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "num_experts": 128,
            "num_experts_per_tok": 8,
        },
    ),
    "gemma-3-27b": (  # the text_config of Gemma3ForConditionalGeneration: the decoder without vision
        "google/gemma-3-27b-it",
        {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262208}
        | _shape(hidden=5376, intermediate=21504, heads=32, layers=62, kv_heads=16)
        | {"head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024, "sliding_window_pattern": 6}
        | {"rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000.0}
        | {"rope_local_base_freq": 10000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-06}
        | {"hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    ),
    "phi-3-medium": (
        "microsoft/Phi-3-medium-4k-instruct",
        {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064}
        | _shape(hidden=5120, intermediate=17920, heads=40, layers=40, kv_heads=10)
        | {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096}
        | {
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "sliding_window": 2047,
            "tie_word_embeddings": False,
        },
    ),
    "opt-30b": (
        "facebook/opt-30b",
        _OPT
        | {"hidden_size": 7168, "ffn_dim": 28672, "num_attention_heads": 56}
        | {"num_hidden_layers": 48, "word_embed_proj_dim": 7168},
    ),
    "opt-66b": (
        "facebook/opt-66b",
        _OPT
        | {"hidden_size": 9216, "ffn_dim": 36864, "num_attention_heads": 72}
        | {"num_hidden_layers": 64, "word_embed_proj_dim": 9216},
    ),
    "bert-base-uncased": (
        "google-bert/bert-base-uncased",
        _BERT
        | {"architectures": ["BertForMaskedLM"], "hidden_size": 768, "intermediate_size": 3072}
        | {"num_hidden_layers": 12, "transformers_version": "4.6.0.dev0"},
    ),
    "all-minilm-l6-v2": (
        "sentence-transformers/all-MiniLM-L6-v2",
        {"_name_or_path": "nreimers/MiniLM-L6-H384-uncased", "architectures": ["BertModel"]}
        | _BERT
        | {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6}
        | {"transformers_version": "4.8.2"},
    ),
}


def known_models() -> list[str]:
    """Preset names, e.g. ["llama-2-7b", ..., "opt-66b"]."""
    return list(PRESETS)


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A preset by name (case-insensitive), or a local HF model directory / its config.json."""
    key = str(name_or_path).strip().lower()
    if key in PRESETS:
        repo, config = PRESETS[key]
        return model_from_config(config, name=key, source=f"{repo} config.json")
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise TesselError(
            f"{name_or_path!r} is neither a model preset nor a config.json (looked for {path}); "
            f"presets: {', '.join(known_models())}"
        )
    file = config_path(path)
    fields = read_json_object(file)
    if encoder_architecture(fields) is not None:
        bert = BertConfig.from_dict(fields, source=str(file))
        return spec_from_bert(bert, name=file.parent.name, source=str(file))
    config = read_hf_config(path)
    return spec_from_hf(config, name=Path(config.source).parent.name or config.source)


def model_from_config(config: dict, *, name: str, source: str) -> ModelSpec:
    """A ModelSpec from HF config.json fields (Llama/Mistral/Qwen2/Mixtral, OPT or BERT)."""
    if encoder_architecture(config) is not None:
        return spec_from_bert(BertConfig.from_dict(config, source=source or name), name=name, source=source)
    return spec_from_hf(parse_hf_config(config, source=source or name), name=name)


def spec_from_bert(config: BertConfig, *, name: str, source: str) -> ModelSpec:
    """The cost model's view of a BERT encoder: q/k/v/o and fc1/fc2 with biases, two LayerNorms a layer,
    word + position + token-type embeddings (and their LayerNorm) on the first stage, nothing after."""
    return ModelSpec(
        name=name,
        architecture=config.architecture,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        tied_embeddings=True,  # no LM head: nothing to hold on the last stage
        max_position_embeddings=config.max_position_embeddings,
        mlp_kind="plain",
        norm_kind="layernorm",
        attention_bias="all",
        mlp_bias=True,
        learned_position_rows=config.max_position_embeddings + config.type_vocab_size,
        source=source,
        encoder=True,
    )


def spec_from_hf(config: HFConfig, *, name: str) -> ModelSpec:
    """The cost model's view of a validated config."""
    if config.family == "opt":
        family = {"mlp_kind": "plain", "norm_kind": "layernorm"}
        family |= {"learned_position_rows": config.max_position_embeddings + OPT_POSITION_OFFSET}
        attention_bias = "all" if config.attention_bias else "none"
    else:
        family = {"rope_theta": config.rope_theta, "qk_norm": config.qk_norm}
        family["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
        qkv_biased = config.family in ("qwen2", "qwen2_moe")
        attention_bias = "qkv" if qkv_biased else ("all" if config.attention_bias else "none")
    try:
        return ModelSpec(
            name=name,
            architecture=config.architecture,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            intermediate_size=config.moe_intermediate_size or config.intermediate_size,
            vocab_size=config.vocab_size,
            tied_embeddings=config.tie_word_embeddings,
            max_position_embeddings=config.max_position_embeddings,
            attention_bias=attention_bias,
            mlp_bias=config.mlp_bias,
            num_experts=config.num_local_experts,
            experts_per_token=config.num_experts_per_tok,
            source=config.source,
            **family,
        )
    except ValueError as error:
        raise TesselError(f"{config.source}: {error}") from None
