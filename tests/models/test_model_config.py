"""config.json parsing: both rope formats, explicit head_dim, EOS lists, errors."""

from __future__ import annotations

import json

import pytest

from tessel.errors import TesselError
from tessel.models.config import ModelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
}


def test_transformers4_rope_scaling_and_eos_list() -> None:
    d = {
        **BASE,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [128001, 128008, 128009],
    }
    c = ModelConfig.from_dict(d)
    assert c.rope_theta == 500000.0
    assert (
        c.rope_scaling is not None and c.rope_scaling.rope_type == "llama3" and c.rope_scaling.factor == 8.0
    )
    assert c.eos_token_ids == [128001, 128008, 128009]
    assert c.num_key_value_heads == 4 and c.head_dim == 16


def test_transformers5_rope_parameters_explicit_head_dim_and_qwen2_bias() -> None:
    d = {
        **BASE,
        "architectures": ["Qwen2ForCausalLM"],
        "head_dim": 32,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_window": 4096,
        "use_sliding_window": False,
    }
    c = ModelConfig.from_dict(d)
    assert (c.head_dim, c.q_size, c.kv_size) == (32, 128, 64)
    assert c.rope_theta == 1e6 and c.rope_scaling.rope_type == "linear"
    assert c.qkv_bias and not c.o_bias and c.sliding_window is None


def test_default_rope_means_no_scaling_and_model_type_fallback() -> None:
    d = {**BASE, "rope_scaling": None}
    del d["architectures"]
    d["model_type"] = "mistral"
    c = ModelConfig.from_dict(d)
    assert c.architecture == "MistralForCausalLM" and c.rope_scaling is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ],
)
def test_unsupported_configs_are_user_errors(change: dict, message: str) -> None:
    with pytest.raises(TesselError, match=message):
        ModelConfig.from_dict({**BASE, **change})


def test_from_dir_merges_generation_config_eos_and_reports_missing_files(tmp_path) -> None:
    with pytest.raises(TesselError, match="config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == [2, 7]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(TesselError, match="missing or has a bad field"):
        ModelConfig.from_dir(tmp_path)
