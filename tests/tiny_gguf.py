"""A tiny Llama GGUF file written from a tiny checkpoint (tests/tiny_models.py), for tests of `.gguf` inputs.

Float32 tensors, llama.cpp's names and its q/k row permutation (convert_hf_to_gguf's `permute`), the
checkpoint's byte-level BPE tokenizer as a `gpt2` GGUF tokenizer. `tessel.models.gguf` turns it
back into the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

LAYER_TENSORS = {  # HF leaf -> GGUF blk.N.<name>
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLOBAL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (the inverse of gguf_import._unpermute)."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def _gguf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{suffix}"
    _, _, index, rest = base.split(".", 3)
    return f"blk.{index}.{LAYER_TENSORS[rest]}.{suffix}"


def write_tiny_gguf(checkpoint: Path, path: Path, q8_0: bool = False) -> Path:
    """`checkpoint` (a float32 Llama from tiny_models, untied) as the GGUF file `path`; with `q8_0`, the
    decoder-layer linears are stored as Q8_0 blocks (llama.cpp's reference rounding, `gguf.quants`)."""
    import gguf
    from gguf.quants import quantize

    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    added = {t["id"]: t["content"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([added.get(i, token) for token, i in vocab])
    writer.add_token_types([3 if i in added else 1 for _, i in vocab])  # 3: control, 1: normal
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_add_bos_token(True)  # the checkpoint's tokenizer prepends <s>
    writer.add_eos_token_id(config["eos_token_id"])
    for name, value in load_file(str(checkpoint / "model.safetensors")).items():
        if ".q_proj." in name:
            value = _permute(value, heads)
        elif ".k_proj." in name:
            value = _permute(value, kv_heads)
        value = np.ascontiguousarray(value, dtype=np.float32)
        if q8_0 and name.endswith("proj.weight"):
            blocks = quantize(value, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(
                _gguf_name(name), blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            writer.add_tensor(_gguf_name(name), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
