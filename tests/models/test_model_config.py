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
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM",
        ),
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


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_configs_transformers_writes_read_as_transformers_reads_them(
    tmp_path, family: str, rope_type: str
) -> None:
    """Oracle: transformers 5 itself writes the config (rope_parameters) and reads it back."""
    transformers = pytest.importorskip("transformers")
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[family]
    rope = {"rope_type": rope_type, "rope_theta": 123456.0}
    if rope_type != "default":
        rope |= {"factor": 3.0}
    if rope_type == "llama3":
        rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = config_cls(
        hidden_size=96, intermediate_size=50, num_attention_heads=6, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=300, max_position_embeddings=256, rope_parameters=rope,
    )  # fmt: skip
    hf.save_pretrained(tmp_path)
    ours = ModelConfig.from_dir(tmp_path)
    expected = transformers.AutoConfig.from_pretrained(tmp_path)
    assert ours.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
        expected.model_type, "MistralForCausalLM"
    )  # no `architectures` in the file: found from model_type
    assert ours.head_dim == expected.hidden_size // expected.num_attention_heads
    assert ours.num_key_value_heads == expected.num_key_value_heads
    assert ours.rope_theta == expected.rope_parameters["rope_theta"]
    if rope_type == "default":
        assert ours.rope_scaling is None
    else:
        assert ours.rope_scaling.rope_type == expected.rope_parameters["rope_type"]
        assert ours.rope_scaling.factor == expected.rope_parameters["factor"]


def test_real_checkpoint_reads_alike_in_catalog_and_engine(smollm2_dir) -> None:
    """SmolLM2-135M (transformers 5 format: rope_parameters, explicit head_dim): one reader, two views."""
    from tessel.catalog import load_model

    transformers = pytest.importorskip("transformers")
    expected = transformers.AutoConfig.from_pretrained(smollm2_dir)
    engine, spec = ModelConfig.from_dir(smollm2_dir), load_model(smollm2_dir)
    assert (engine.num_hidden_layers, spec.num_layers) == (expected.num_hidden_layers,) * 2 == (30, 30)
    assert (
        (engine.num_attention_heads, engine.num_key_value_heads)
        == (spec.num_heads, spec.num_kv_heads)
        == (9, 3)
    )
    assert engine.head_dim == spec.head_dim == expected.head_dim == 64
    assert engine.rope_theta == spec.rope_theta == expected.rope_parameters["rope_theta"] == 100000.0
    assert engine.tie_word_embeddings and spec.tied_embeddings
    assert engine.rms_norm_eps == expected.rms_norm_eps and engine.rope_scaling is None


def test_engine_refuses_what_only_the_planner_reads() -> None:
    """OPT configs are read for the planner's cost model, but the engine does not run them."""
    with pytest.raises(TesselError, match="the engine runs LlamaForCausalLM"):
        ModelConfig.from_dict({**BASE, "architectures": ["OPTForCausalLM"], "ffn_dim": 128})
    with pytest.raises(TesselError, match="num_attention_heads"):
        ModelConfig.from_dict({**BASE, "num_attention_heads": 0})
