"""Model presets and config.json parsing."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tessel.catalog import ModelSpec, known_models, load_model
from tessel.errors import TesselError

REQUIRED = (
    "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3.1-8b",
    "llama-3.1-70b", "qwen2.5-7b", "qwen2.5-72b", "mistral-7b", "mixtral-8x7b", "opt-30b", "opt-66b",
)  # fmt: skip


def test_required_presets_exist_and_load() -> None:
    assert set(REQUIRED) <= set(known_models())
    for name in REQUIRED:
        model = load_model(name)
        assert isinstance(model, ModelSpec)
        assert model.num_heads * model.head_dim == model.hidden_size
        assert model.source


def test_issue_46_presets_load_with_their_own_head_dims_and_experts() -> None:
    qwen_moe = load_model("qwen3-30b-a3b")
    assert (qwen_moe.num_experts, qwen_moe.experts_per_token, qwen_moe.intermediate_size) == (128, 8, 768)
    assert load_model("qwen3-32b").head_dim == 128 and load_model("qwen3-32b").qk_norm
    assert load_model("gemma-3-27b").tied_embeddings and load_model("gemma-3-27b").head_dim == 128
    assert load_model("phi-3-medium").num_kv_heads == 10
    assert all(load_model(name).source.count("/") == 1 for name in ("mixtral-8x22b", "llama-3.1-405b"))


def test_preset_shapes_match_hf_configs() -> None:
    llama70 = load_model("Llama-3-70B")  # case-insensitive
    assert (llama70.num_layers, llama70.hidden_size, llama70.num_kv_heads) == (80, 8192, 8)
    assert (llama70.intermediate_size, llama70.vocab_size) == (28672, 128256)
    assert load_model("llama-3.1-8b").max_position_embeddings == 131072
    assert load_model("qwen2.5-7b").attention_bias == "qkv"
    mixtral = load_model("mixtral-8x7b")
    assert (mixtral.num_experts, mixtral.experts_per_token) == (8, 2)
    opt = load_model("opt-30b")
    assert (opt.mlp_kind, opt.norm_kind, opt.tied_embeddings) == ("plain", "layernorm", True)
    assert opt.learned_position_rows == 2048 + 2


def _random_llama_config(rng: random.Random) -> dict:
    kv_heads = rng.choice([1, 2, 4])
    heads = kv_heads * rng.choice([1, 2, 3])
    head_dim = rng.choice([16, 32, 64])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": heads * head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": rng.randint(1, 7),
        "intermediate_size": rng.randint(17, 500),
        "vocab_size": rng.randint(100, 1000),
        "max_position_embeddings": 1024,
        "tie_word_embeddings": rng.random() < 0.5,
    }


@pytest.mark.parametrize("as_file", [False, True])
def test_load_from_directory_or_file(tmp_path: Path, as_file: bool) -> None:
    config = _random_llama_config(random.Random())
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path / "config.json" if as_file else tmp_path)
    assert model.hidden_size == config["hidden_size"]
    assert model.num_kv_heads == config["num_key_value_heads"]
    assert model.num_layers == config["num_hidden_layers"]
    assert model.intermediate_size == config["intermediate_size"]
    assert model.tied_embeddings == config["tie_word_embeddings"]
    assert model.head_dim == config["hidden_size"] // config["num_attention_heads"]


def test_missing_field_names_file_and_field(tmp_path: Path) -> None:
    config = _random_llama_config(random.Random())
    del config["intermediate_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(TesselError) as info:
        load_model(tmp_path)
    assert str(path) in str(info.value) and "intermediate_size" in str(info.value)


def test_bad_values_and_paths_are_user_errors(tmp_path: Path) -> None:
    config = _random_llama_config(random.Random()) | {"num_hidden_layers": "eight"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TesselError, match="num_hidden_layers"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(TesselError, match="not valid JSON"):
        load_model(tmp_path)
    with pytest.raises(TesselError, match="llama-3-70b"):  # lists the presets
        load_model(tmp_path / "nowhere")
