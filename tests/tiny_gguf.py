"""A tiny Llama GGUF file written from a tiny checkpoint (tests/tiny_models.py), for tests of `.gguf` inputs.

Float32 tensors, llama.cpp's names and its q/k row permutation (convert_hf_to_gguf's `permute`), the
checkpoint's byte-level BPE tokenizer as a `gpt2` GGUF tokenizer. `tessel.models.gguf` turns it
back into the checkpoint.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

LAYER_TENSORS = {  # HF leaf -> GGUF blk.N.<name>
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA3_TENSORS = LAYER_TENSORS | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GGUF_ARCHS = {  # model_type -> general.architecture
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
}
MOE_TENSORS = {  # HF leaf of an MoE layer -> GGUF blk.N.<name>
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
EXPERT_STACKS = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}
GLOBAL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (the inverse of gguf_import._unpermute)."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def _gguf_name(name: str, arch: str = "llama") -> str:
    base, _, suffix = name.rpartition(".")
    if base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{suffix}"
    _, _, index, rest = base.split(".", 3)
    names = (GEMMA3_TENSORS if arch == "gemma3" else LAYER_TENSORS) | MOE_TENSORS
    return f"blk.{index}.{names[rest]}.{suffix}"


def write_tiny_gguf(
    checkpoint: Path, path: Path, q8_0: bool = False, retype: dict[str, str] | None = None
) -> Path:
    """`checkpoint` (a float32 Llama, Qwen2, Qwen3 or Gemma 3 from tiny_models) as the GGUF file `path`,
    as convert_hf_to_gguf writes it (Llama's q/k rows permuted, Gemma's norms as 1 + w); with `q8_0`,
    the decoder-layer linears are stored as Q8_0 blocks (llama.cpp's reference rounding, `gguf.quants`);
    `retype` stores the named GGUF tensors as another numpy dtype (float64 -> F64, int32 -> I32)."""
    import gguf
    from gguf.quants import quantize

    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    arch = GGUF_ARCHS[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
        if "norm_topk_prob" in config:
            writer.add_expert_weights_norm(config["norm_topk_prob"])
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    added = {t["id"]: t["content"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([added.get(i, token) for token, i in vocab])
    writer.add_token_types([3 if i in added else 1 for _, i in vocab])  # 3: control, 1: normal
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_add_bos_token(True)  # the checkpoint's tokenizer prepends <s>
    writer.add_eos_token_id(config["eos_token_id"])
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = defaultdict(dict)
    for name, value in load_file(str(checkpoint / "model.safetensors")).items():
        expert = EXPERT.match(name)
        if expert:  # llama.cpp stacks each projection of the experts: [E, rows, cols]
            stacks[(expert.group(1), EXPERT_STACKS[expert.group(3)])][int(expert.group(2))] = value
            continue
        if name.endswith("shared_expert_gate.weight"):
            value = value.reshape(-1)
        if arch == "llama" and ".q_proj." in name:
            value = _permute(value, heads)
        elif arch == "llama" and ".k_proj." in name:
            value = _permute(value, kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            value = value + 1.0
        value = np.ascontiguousarray(value, dtype=np.float32)
        if q8_0 and name.endswith("proj.weight"):
            blocks = quantize(value, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(
                _gguf_name(name, arch),
                blocks,
                raw_shape=blocks.shape,
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            gguf_name = _gguf_name(name, arch)
            writer.add_tensor(gguf_name, value.astype((retype or {}).get(gguf_name, np.float32)))
    for (layer, proj), by_expert in stacks.items():
        stacked = np.ascontiguousarray(np.stack([by_expert[e] for e in sorted(by_expert)]), dtype=np.float32)
        writer.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
