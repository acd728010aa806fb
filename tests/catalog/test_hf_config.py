"""The one config.json reader: hostile values and files give a config or a TesselError, never a crash."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessel.catalog import load_model
from tessel.catalog.hf_config import (
    MAX_COUNT,
    ROPE_TYPES,
    HFConfig,
    parse_hf_config,
    read_hf_config,
)
from tessel.errors import TesselError

VALID = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "vocab_size": 500,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}
FIELDS = sorted(
    set(VALID)
    | {"head_dim", "rope_scaling", "rope_parameters", "sliding_window", "use_sliding_window"}
    | {"num_local_experts", "num_experts_per_tok", "attention_bias", "mlp_bias", "hidden_act"}
    | {"bos_token_id", "torch_dtype", "ffn_dim", "word_embed_proj_dim", "enable_bias"}
)

HOSTILE_SCALARS = st.one_of(
    st.sampled_from([0, -1, -(2**63), 2**31, 2**64, 10**400, 1.5, 0.0, -0.0, 1e308, True, False, None]),
    st.sampled_from([math.nan, math.inf, -math.inf, "", "64", "llama", "opt", "\ud800", "yarn"]),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
JSON_VALUES = st.recursive(HOSTILE_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=12) | st.sampled_from(["rope_type", "factor", "rope_theta", "type"]), inner, max_size=4
), max_leaves=12)  # fmt: skip
ROPE_SETTINGS = st.dictionaries(
    st.sampled_from(
        ["rope_type", "type", "factor", "rope_theta", "low_freq_factor", "high_freq_factor"]
        + ["original_max_position_embeddings"]
    ),
    st.one_of(st.sampled_from([*ROPE_TYPES, "yarn", "dynamic"]), HOSTILE_SCALARS),
    max_size=5,
)


def check_invariants(config: HFConfig) -> None:
    """What every consumer relies on once the reader has said yes."""
    counts = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    counts += (config.num_hidden_layers, config.vocab_size, config.intermediate_size)
    assert all(isinstance(n, int) and 1 <= n <= MAX_COUNT for n in counts)
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert 1 <= config.num_experts_per_tok <= config.num_local_experts
    assert math.isfinite(config.rms_norm_eps) and config.rms_norm_eps > 0
    assert config.rope_theta is None or (math.isfinite(config.rope_theta) and config.rope_theta > 0)
    if config.rope_scaling is not None:
        assert config.rope_scaling.rope_type in ROPE_TYPES
        assert math.isfinite(config.rope_scaling.factor) and config.rope_scaling.factor > 0
    assert all(isinstance(e, int) and e >= 0 for e in config.eos_token_ids)


def parse_or_user_error(data: object) -> HFConfig | None:
    try:
        config = parse_hf_config(data, source="fuzz/config.json")  # type: ignore[arg-type]
    except TesselError as error:
        assert "fuzz/config.json" in str(error)
        return None
    check_invariants(config)
    return config


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, min_size=1, max_size=4))
def test_hostile_field_values_give_a_config_or_a_user_error(changes: dict) -> None:
    parse_or_user_error(VALID | changes)


@settings(max_examples=200, deadline=None)
@given(ROPE_SETTINGS, ROPE_SETTINGS, st.sampled_from(["llama", "qwen2", "mistral"]))
def test_hostile_rope_settings_in_either_format(scaling: dict, parameters: dict, family: str) -> None:
    parse_or_user_error(VALID | {"model_type": family, "architectures": None} | {"rope_scaling": scaling})
    parse_or_user_error(VALID | {"rope_parameters": parameters})


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES)
def test_any_json_document_gives_a_config_or_a_user_error(document: object) -> None:
    parse_or_user_error(document)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_any_file_bytes_give_a_config_or_a_user_error(tmp_path_factory, raw: bytes) -> None:
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_bytes(raw)
    with pytest.raises(TesselError, match="config.json"):
        read_hf_config(path)  # no random byte string of this size is a valid Llama config


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "not a UTF-8 text file"),
        ("{\"hidden_size\": 64}".encode("utf-16"), "not a UTF-8 text file"),
        (b"[1, 2, 3]", "got a JSON list"),
        (b"\"config\"", "got a JSON string"),
        (b"[" * 100_000, "not valid JSON"),
        (b"{\"hidden_size\": " + b"9" * 5000 + b"}", "not valid JSON"),
        (b"{\"hidden_size\": 64,", "not valid JSON"),
    ],
)  # fmt: skip
def test_unreadable_files_are_named_user_errors(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / "config.json").write_bytes(content)
    for reader in (read_hf_config, load_model):
        with pytest.raises(TesselError, match=message) as info:
            reader(tmp_path)
        assert str(tmp_path / "config.json") in str(info.value)


def test_directory_without_config_json_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(TesselError, match="has no config.json"):
        read_hf_config(tmp_path)
    with pytest.raises(TesselError, match="has no config.json"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_attention_heads": 0}, "num_attention_heads"),  # issue 14: ZeroDivisionError before
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"hidden_size": -64}, "hidden_size"),
        ({"num_hidden_layers": 2**40}, "num_hidden_layers"),
        ({"num_hidden_layers": 1_000_000_000}, "num_hidden_layers"),  # issue 27: `tessel plan` hung
        ({"vocab_size": math.nan}, "vocab_size"),
        ({"intermediate_size": "96"}, "intermediate_size"),
        ({"num_attention_heads": 5}, "num_attention_heads"),  # 64 is not a multiple of 5
        ({"num_key_value_heads": 3}, "num_key_value_heads"),  # 4 heads are not a multiple of 3
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "factor"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"eos_token_id": [2, -3]}, "eos_token_id"),
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"head_dim": 7}, "head_dim"),  # issue 27: rotary embeddings turn pairs of dimensions
        ({"hidden_size": 63, "num_attention_heads": 9, "num_key_value_heads": 3}, "head_dim"),  # 63 / 9 = 7
        ({"model_type": []}, "model_type"),  # issue 27: transformers' tokenizer crashed on it
        ({"hidden_size": "64"}, "hidden_size"),
        ({"vocab_size": 1e12}, "vocab_size"),
        ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
    ],
)
def test_bad_fields_name_the_file_and_the_field(tmp_path: Path, change: dict, field: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(VALID | change))
    with pytest.raises(TesselError) as info:
        load_model(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value) and field in str(info.value)


def test_head_dim_given_need_not_divide_the_hidden_size() -> None:
    config = parse_hf_config(
        VALID | {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16}, source="x"
    )
    assert (config.head_dim, config.hidden_size, config.num_attention_heads) == (16, 64, 6)


def test_both_rope_formats_read_the_same() -> None:
    """transformers 4.x (`rope_theta` + `rope_scaling`) and 5 (`rope_parameters`) spell one thing."""
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    scaling |= {"original_max_position_embeddings": 8192}
    old = parse_hf_config(
        VALID | {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}}, source="x"
    )
    new_fields = {k: v for k, v in VALID.items() if k != "rope_theta"}
    new_fields["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, **scaling}
    new = parse_hf_config(new_fields, source="x")
    assert (old.rope_theta, old.rope_scaling) == (new.rope_theta, new.rope_scaling) == (5e5, new.rope_scaling)
    assert new.rope_scaling is not None and new.rope_scaling.factor == 8.0
    default = parse_hf_config(
        new_fields | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}, source="x"
    )
    assert (default.rope_theta, default.rope_scaling) == (1e5, None)


def test_plan_refuses_a_config_with_a_billion_layers(tmp_path) -> None:
    """Issue 27: `tessel plan --model DIR` with num_hidden_layers 1e9 ran for minutes pricing layers."""
    from tessel.plan.api import PlanSettings, make_plan

    fields = {**VALID, "num_hidden_layers": 1_000_000_000}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(TesselError, match="num_hidden_layers.*4096"):
        make_plan(str(tmp_path), "local-cpu", "default", PlanSettings())
