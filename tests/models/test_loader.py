"""Loading safetensors checkpoints: sharded == single, tied heads, dtypes, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from tessel.errors import TesselError
from tessel.models import load_model


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_loads_like_the_single_file_one(checkpoints, tmp_path) -> None:
    sharded = checkpoints("llama_sharded")
    assert (sharded / "model.safetensors.index.json").exists()
    single = tiny_models.make_tiny_checkpoint(tmp_path / "single", "llama", seed=1)
    a, b = state(load_model(sharded, torch.float32)), state(load_model(single, torch.float32))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_merged_projections_hold_the_hf_tensors(checkpoints) -> None:
    path = checkpoints("qwen2")
    model = load_model(path, torch.float32)
    hf = load_file(str(path / "model.safetensors"))
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert torch.equal(q, hf["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(v, hf["model.layers.1.self_attn.v_proj.weight"])
    assert torch.equal(
        attn.qkv_proj.bias[attn.q_size : attn.q_size + attn.kv_size],
        hf["model.layers.1.self_attn.k_proj.bias"],
    )
    up = model.model.layers[0].mlp.gate_up_proj.weight[model.config.intermediate_size :]
    assert torch.equal(up, hf["model.layers.0.mlp.up_proj.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loads_in_the_requested_dtype(checkpoints, dtype: torch.dtype) -> None:
    model = load_model(checkpoints("llama_bf16"), dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert not any(p.requires_grad for p in model.parameters())


def test_missing_unexpected_and_misshapen_tensors_are_user_errors(checkpoints, tmp_path) -> None:
    src = checkpoints("llama")
    tensors = load_file(str(src / "model.safetensors"))
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)

    def write(t: dict[str, torch.Tensor]) -> None:
        save_file(t, str(bad / "model.safetensors"))

    write({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.weight"})
    with pytest.raises(TesselError, match="lacks 1 tensor"):
        load_model(bad, torch.float32)
    write({**tensors, "model.layers.0.self_attn.extra.weight": torch.zeros(2)})
    with pytest.raises(TesselError, match="unexpected tensor"):
        load_model(bad, torch.float32)
    write({**tensors, "model.norm.weight": torch.zeros(3)})
    with pytest.raises(TesselError, match="shape"):
        load_model(bad, torch.float32)
    (bad / "model.safetensors").unlink()
    with pytest.raises(TesselError, match="safetensors"):
        load_model(bad, torch.float32)


def test_missing_shard_is_a_user_error(checkpoints, tmp_path) -> None:
    bad = tmp_path / "sharded"
    shutil.copytree(checkpoints("llama_sharded"), bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    (bad / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(TesselError, match="missing"):
        load_model(bad, torch.float32)


def test_mistral_sliding_window_no_longer_caps_max_model_len(tmp_path) -> None:
    """The window is honoured in attention (tests/models/test_architectures.py), so prompts may be longer."""
    from tessel.engine.llm_engine import LLMEngine

    path = tiny_models.make_tiny_checkpoint(tmp_path / "m", "mistral", sliding_window=64)
    assert LLMEngine(path).max_model_len == 1024
    assert LLMEngine(path, max_model_len=128).max_model_len == 128
