"""Parameter and byte counts, held against HF transformers models built on the meta device."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tessel.catalog import load_model
from tessel.cost import (
    embedding_bytes,
    hidden_bytes,
    kv_bytes_per_token,
    layer_params,
    lm_head_bytes,
    total_params,
    unit_params,
    weight_bytes,
)
from tessel.cost.layer import embedding_params

ATTENTION_MARKERS = ("self_attn", "input_layernorm", "self_attn_layer_norm")


def test_llama_2_7b_by_hand() -> None:
    model = load_model("llama-2-7b")
    h, f, n_layers, vocab = 4096, 11008, 32, 32000
    per_layer = 4 * h * h + 3 * h * f + 2 * h  # q, k, v, o (MHA) + gate, up, down + two RMSNorms
    assert layer_params(model) == per_layer == 202_383_360
    assert total_params(model) == n_layers * per_layer + 2 * vocab * h + h == 6_738_415_616  # "6.74B"


def test_published_totals() -> None:
    assert total_params(load_model("llama-3-8b")) == 8_030_261_248  # Meta: 8.03B
    assert round(total_params(load_model("llama-3-70b")) / 1e9, 1) == 70.6  # Meta: 70.6B
    assert round(total_params(load_model("mixtral-8x7b")) / 1e9, 1) == 46.7  # Mistral: 46.7B
    assert round(total_params(load_model("qwen2.5-7b")) / 1e9, 2) == 7.62  # Qwen: 7.61B (7.62 rounded up)
    assert round(total_params(load_model("qwen2.5-72b")) / 1e9, 1) == 72.7  # Qwen: 72.7B
    assert round(total_params(load_model("opt-30b")) / 1e9) == 30


def _hf_model(arch: str, rng: random.Random):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kv_heads = rng.choice([1, 2])
    heads = kv_heads * rng.choice([1, 2, 3])
    head_dim = rng.choice([8, 16])
    shape = {
        "hidden_size": heads * head_dim,
        "num_attention_heads": heads,
        "num_hidden_layers": rng.randint(1, 3),
        "vocab_size": rng.randint(50, 300),
        "max_position_embeddings": rng.randint(16, 64),
        "tie_word_embeddings": rng.random() < 0.5,
    }
    width = rng.randint(9, 70)
    if arch == "opt":
        config = transformers.OPTConfig(**shape, ffn_dim=width, word_embed_proj_dim=shape["hidden_size"])
        cls = transformers.OPTForCausalLM
    else:
        shape |= {"intermediate_size": width, "num_key_value_heads": kv_heads}
        config_cls, cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
            "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        }[arch]
        extra = (
            {"num_local_experts": rng.choice([3, 4]), "num_experts_per_tok": 2} if arch == "mixtral" else {}
        )
        config = config_cls(**shape, **extra)
    with torch.device("meta"):
        return config, cls(config)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "mixtral", "opt"])
def test_params_match_hf_model(tmp_path: Path, arch: str) -> None:
    config, hf = _hf_model(arch, random.Random())
    (tmp_path / "config.json").write_text(config.to_json_string())
    model = load_model(tmp_path)
    params = dict(hf.named_parameters())  # tied weights appear once
    assert total_params(model) == sum(p.numel() for p in params.values())
    layer0 = {name: p.numel() for name, p in params.items() if ".layers.0." in name}
    attention = sum(n for name, n in layer0.items() if any(m in name for m in ATTENTION_MARKERS))
    assert unit_params(model, "attention") == attention
    assert unit_params(model, "mlp") == sum(layer0.values()) - attention
    embeds = sum(
        p.numel() for name, p in params.items() if "embed_tokens" in name or "embed_positions" in name
    )
    assert embedding_params(model) == embeds


def test_weight_bytes_by_dtype() -> None:
    model = load_model("llama-3-70b")
    for kind in ("layer", "attention", "mlp"):
        assert weight_bytes(model, kind, "fp16") == 2 * unit_params(model, kind)
        assert weight_bytes(model, kind, "fp32") == 4 * unit_params(model, kind)
    assert weight_bytes(model, "layer", "fp16") == weight_bytes(model, "attention", "fp16") + weight_bytes(
        model, "mlp", "fp16"
    )
    # int8 halves the matmul weights; the two RMSNorm vectors stay fp16
    assert weight_bytes(model, "layer", "int8") == (layer_params(model) - 2 * 8192) + 2 * 2 * 8192
    assert embedding_bytes(model, "int8") == embedding_bytes(model, "fp16") == 2 * 128256 * 8192


def test_tied_lm_head_needs_a_copy_unless_on_the_first_stage() -> None:
    tied, untied = load_model("opt-30b"), load_model("llama-3-8b")
    h = tied.hidden_size
    assert lm_head_bytes(tied, "fp16") == 2 * (tied.vocab_size * h + 2 * h)  # copy + LayerNorm
    assert lm_head_bytes(tied, "fp16", on_first_stage=True) == 2 * 2 * h  # only the final norm
    assert lm_head_bytes(untied, "fp16", on_first_stage=True) == lm_head_bytes(untied, "fp16")


def test_kv_and_hidden_bytes() -> None:
    model = load_model("llama-3-70b")
    assert kv_bytes_per_token(model) == 2 * 8 * 128 * 2 == 4096
    assert kv_bytes_per_token(model, "fp32") == 8192
    assert kv_bytes_per_token(load_model("llama-2-7b"), "int8") == 2 * 32 * 128
    tokens = random.randint(1, 5000)
    assert hidden_bytes(model, tokens) == tokens * 8192 * 2
    assert hidden_bytes(model, tokens, "fp32") == tokens * 8192 * 4


def test_issue_46_presets_match_published_totals() -> None:
    """Totals the model cards give; MoE: every expert held, only the active ones computed."""
    from tessel.cost.layer import matmul_flops

    def billions(name: str) -> float:
        return round(total_params(load_model(name)) / 1e9, 1)

    def active_billions(name: str) -> float:  # active matmul parameters + embedding + LM head
        model = load_model(name)
        head = 0 if model.tied_embeddings else model.vocab_size * model.hidden_size
        active = model.num_layers * matmul_flops(model, "layer", 1) / 2 + embedding_params(model) + head
        return round(active / 1e9, 1)

    assert billions("qwen3-32b") == 32.8  # Qwen: 32.8B
    assert billions("qwen3-30b-a3b") == 30.5  # Qwen: 30.5B, 3.3B active
    assert abs(active_billions("qwen3-30b-a3b") - 3.3) < 0.15
    assert billions("mixtral-8x22b") == 140.6  # Mistral: 141B, 39B active
    assert abs(active_billions("mixtral-8x22b") - 39) <= 0.5
    assert billions("phi-3-medium") == 14.0  # Microsoft: 14B
    assert billions("llama-3.1-405b") == 405.9  # Meta: 405B
    assert billions("gemma-3-27b") == 27.0  # Google: 27B (the decoder, without the vision tower)
