"""Tiny random Llama-family checkpoints, built locally (no downloads), for tests and benchmarks.

`make_tiny_checkpoint(path, arch)` writes a Hugging Face model directory: config.json,
safetensors weights (sharded with `model.safetensors.index.json` when `shards > 1`), a
generation_config.json and a byte-level BPE tokenizer trained on an in-code text, with `<s>`/`</s>`
tokens, a chat template, and `AutoTokenizer.from_pretrained(path)` working offline. The model's
`vocab_size` equals the tokenizer's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ARCHS = ("llama", "qwen2", "mistral", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "phi3", "gemma3")

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)  # ids 0, 1, 2, 3
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Training text for the tokenizer: a few hundred words of plain English with digits and punctuation.
CORPUS = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
To be or not to be, that is the question. All that glitters is not gold. The early bird catches the worm.
Once upon a time there was a small model that planned inference on clusters of different graphics cards.
It cut long prompts into chunks, placed layers on devices, and counted tokens per second with care.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris is.
One two three four five six seven eight nine ten. 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024.
The cat sat on the mat. The dog sat on the log. The bird sang in the tree, and the sun was warm.
Attention is all you need. Large language models predict the next token from the previous ones.
Paged attention stores keys and values in blocks; a block table maps positions to blocks in a pool.
User: tell me a story. Assistant: once upon a time, in a land far away, lived a curious engineer.
def main(): print("hello") # code, too: for i in range(10): x = x + i; return x
"""

# Tiny shapes: small enough for fast tests, deep and wide enough to exercise GQA and RoPE.
DEFAULT_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    # Wider than HF's 0.02 so that random logits are well separated and greedy argmax is stable.
    "initializer_range": 0.1,
}


CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "mistral": "MistralConfig",
    "qwen3": "Qwen3Config",
    "mixtral": "MixtralConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "phi3": "Phi3Config",
    "gemma3": "Gemma3TextConfig",
}
# What each relative needs beyond DEFAULT_SHAPE to exercise its own parts (experts small and several).
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 96,
    },
    "qwen3_moe": {
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
    },
    "gemma3": {
        "head_dim": 32,
        "sliding_window": 8,
        "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "query_pre_attn_scalar": 24,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    },
}


def build_tokenizer(vocab_size: int = 384) -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` trained on CORPUS; BOS is prepended on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line for line in CORPUS.splitlines() if line], trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def _config(arch: str, vocab_size: int, tokenizer: Any, num_kv_heads: int, tie: bool, **kw: Any) -> Any:
    import transformers

    cls = getattr(transformers, CONFIG_CLASSES[arch])
    args = {
        **DEFAULT_SHAPE,
        "vocab_size": vocab_size,
        "num_key_value_heads": num_kv_heads,
        "tie_word_embeddings": tie,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch in ("mistral", "mixtral", "phi3"):
        args["sliding_window"] = None
    args.update(ARCH_DEFAULTS.get(arch, {}))
    args.update(kw)
    return cls(**args)


def make_tiny_checkpoint(
    path: str | Path,
    arch: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    num_kv_heads: int = 2,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    shards: int = 1,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random `arch` model + tokenizer to `path` and return `path`.

    `config_overrides` go to the HF config (e.g. `hidden_size=96, head_dim=32, rope_theta=5e5`);
    `vocab_size=N` larger than the tokenizer's pads the tokenizer with `<extra_i>` tokens.
    `rope_scaling` is the HF dict, e.g. `{"rope_type": "llama3", "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}`.
    """
    from transformers import AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for stale in [*path.glob("*.safetensors"), *path.glob("*.safetensors.index.json")]:
        stale.unlink()  # a re-used directory must not keep an old shard index

    tokenizer = build_tokenizer()
    vocab_size = int(config_overrides.pop("vocab_size", len(tokenizer)))
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)}")
    if vocab_size > len(tokenizer):
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(vocab_size - len(tokenizer))])
    assert len(tokenizer) == vocab_size

    if rope_scaling is not None:
        config_overrides["rope_scaling"] = dict(rope_scaling)
    config = _config(arch, vocab_size, tokenizer, num_kv_heads, tie_word_embeddings, **config_overrides)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random norm weights too (HF initialises them to ones), so a wrong norm cannot pass.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    model = model.to(dtype)
    model.config.use_cache = True

    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if shards > 1:
        total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        save_kwargs["max_shard_size"] = max(1, total_bytes // shards + 1)
    model.save_pretrained(path, **save_kwargs)
    tokenizer.save_pretrained(path)
    if shards > 1 and not (path / "model.safetensors.index.json").exists():
        raise RuntimeError("save_pretrained wrote no shard index; lower max_shard_size")
    return path


def read_config(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())


# Checkpoints the engine and model tests share: name -> make_tiny_checkpoint arguments.
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},  # GQA 4 q heads : 2 kv heads, untied
    "llama31_tied": {
        "arch": "llama",
        "tie_word_embeddings": True,
        "rope_scaling": LLAMA3_SCALING,
        "rope_theta": 5e5,
    },
    "llama_linear_mha": {
        "arch": "llama",
        "num_kv_heads": 4,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
    "qwen2": {"arch": "qwen2", "tie_word_embeddings": True, "num_kv_heads": 1},
    "mistral_head_dim": {"arch": "mistral", "head_dim": 32, "num_layers": 3},
    "llama_sharded": {"arch": "llama", "shards": 3, "seed": 1},
    "qwen3": {"arch": "qwen3", "seed": 3},
    "qwen3_tied": {"arch": "qwen3", "tie_word_embeddings": True, "num_kv_heads": 1, "seed": 4},
    "mixtral": {"arch": "mixtral", "seed": 5},
    "qwen2_moe": {"arch": "qwen2_moe", "num_layers": 3, "mlp_only_layers": [1], "seed": 6},
    "qwen3_moe": {"arch": "qwen3_moe", "seed": 7},
    "phi3": {"arch": "phi3", "seed": 8},
    "gemma3": {"arch": "gemma3", "tie_word_embeddings": True, "seed": 9},
    # what llama.cpp assumes of a Gemma 3: five sliding layers to one global, attention scalar head_dim
    "gemma3_llamacpp": {
        "arch": "gemma3",
        "tie_word_embeddings": True,
        "seed": 11,
        "num_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "query_pre_attn_scalar": 32,
    },
    "mistral_window": {"arch": "mistral", "sliding_window": 12, "seed": 10},
    "llama_bf16": {"arch": "llama", "dtype": torch.bfloat16, "seed": 2},
}


def variant_checkpoint(root: str | Path, name: str) -> Path:
    """Build (once per `root`) the checkpoint VARIANTS[name] under root/name."""
    path = Path(root) / name
    if (path / "config.json").exists():
        return path
    kwargs = dict(VARIANTS[name])
    if "num_layers" in kwargs:
        kwargs["num_hidden_layers"] = kwargs.pop("num_layers")
    return make_tiny_checkpoint(path, kwargs.pop("arch"), **kwargs)
