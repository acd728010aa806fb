"""tests/tiny_models.py: offline checkpoints that HF and tessel both load."""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig, AutoTokenizer

import tiny_models


def test_tokenizer_loads_offline_and_matches_the_model_vocab(checkpoints) -> None:
    path = checkpoints("qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    assert len(tok) == config.vocab_size
    ids = tok("Hello world! The quick brown fox")["input_ids"]
    assert ids[0] == tok.bos_token_id == config.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world! The quick brown fox"
    assert tok.eos_token_id == config.eos_token_id
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|user|>\nhi</s>\n<|assistant|>\n"


def test_shards_rope_scaling_and_padded_vocab(tmp_path) -> None:
    path = tiny_models.make_tiny_checkpoint(
        tmp_path / "m", "llama", shards=2, rope_scaling={"rope_type": "linear", "factor": 2.0}, vocab_size=400
    )
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    config = tiny_models.read_config(path)
    assert config["rope_parameters"]["rope_type"] == "linear" and config["vocab_size"] == 400
    assert len(AutoTokenizer.from_pretrained(path)) == 400
    again = tiny_models.make_tiny_checkpoint(
        tmp_path / "m", "llama", vocab_size=400
    )  # re-used dir: no stale index
    assert not (again / "model.safetensors.index.json").exists()


def test_same_seed_same_weights(tmp_path) -> None:
    from safetensors.torch import load_file

    a = load_file(str(tiny_models.make_tiny_checkpoint(tmp_path / "a", "mistral") / "model.safetensors"))
    b = load_file(str(tiny_models.make_tiny_checkpoint(tmp_path / "b", "mistral") / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
