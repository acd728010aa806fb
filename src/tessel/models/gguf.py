"""GGUF files (llama.cpp's format) in: a Llama (Mixtral), Qwen2, Qwen3, Gemma 3 or Qwen MoE GGUF
becomes a checkpoint directory the engine loads; MoE files' stacked experts are split per expert.

Read with the `gguf` package, as vLLM does. When every decoder-layer linear is Q8_0, the int8
values and their block scales (one fp16 scale per 32 weights) are kept: the directory is a
compressed-tensors W8A16 checkpoint with group size 32 (`pack-quantized`, 8 bits), which the engine
runs through its quantised-linear swap. Any other mix of types (Q4_1, Q4_K, F16, ...) is
de-quantised to float32 with `gguf.quants.dequantize`. The embedding is always de-quantised.

llama.cpp stores a Llama's q/k rows permuted for its RoPE layout; they are permuted back (for Q8_0
the rows move with their block scales). Qwen2/Qwen3/Gemma 3 rows are stored as in transformers.
Only Llama's Q8_0 linears stay int8; the others are de-quantised (a W8A16 Qwen2/Qwen3 from GGUF is
not wired up yet). Gemma 3's norm weights are stored as 1 + w (llama.cpp
adds the one at conversion): the one is taken off again. Gemma 3's settings llama.cpp does not store
are its: a sliding layer in five of every six, local rope base 10000, attention scalar head_dim
(hidden / heads for the 62-layer 27B). The tokenizer comes from transformers' GGUF reader. The directory
is cached under `$TESSEL_CACHE_DIR/gguf/` keyed by the file's name, size and mtime.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessel.errors import TesselError
from tessel.files import staged_directory
from tessel.models.quantized.compressed_tensors import module_tensors, quantization_config
from tessel.models.quantized.schemes import QuantizedWeight, Scheme

Q8_0_BLOCK = 32  # weights per Q8_0 block (ggml's QK8_0)
Q8_0_BYTES = 2 + Q8_0_BLOCK  # fp16 scale + 32 int8
LAYER_NAMES = {  # GGUF blk.N.<name> -> HF model.layers.N.<name>
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # an MoE layer's router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
EXPERT_STACKS = {  # GGUF's stacked experts [E, rows, cols] -> each expert's HF projection
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
MIXTRAL_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
GEMMA3_LAYER_NAMES = LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
ARCHITECTURES = {  # GGUF general.architecture -> (HF architecture, model_type)
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
MOE_RENORMALISES = {"llama": True, "qwen2moe": False, "qwen3moe": True}  # llama.cpp's norm_w per arch
GEMMA3_SLIDING_PATTERN = 6  # llama.cpp's gemma3 loader: every sixth layer is global
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3
GEMMA3_27B_LAYERS = 62  # llama.cpp scales the 27B's attention by hidden / heads, the others by head_dim
LINEARS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_root() -> Path:
    return Path(os.environ.get("TESSEL_CACHE_DIR", Path.home() / ".cache" / "tessel")) / "gguf"


def resolve_model_path(path: str | Path) -> Path:
    """A model directory as given, or the checkpoint directory of a .gguf file (built once)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf" and path.is_file():
        return gguf_checkpoint(path)
    return path


def gguf_checkpoint(file: Path) -> Path:
    """The checkpoint directory of `file` in tessel's cache, converted on first use.

    Built in a staging directory and moved into place; a leftover cache entry without config.json is
    replaced only when tessel wrote it (`tessel.files.staged_directory`, which never removes others)."""
    stat = file.stat()
    target = cache_root() / f"{file.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (target / "config.json").is_file():
        return target
    with staged_directory(target, "GGUF cache entry", inputs=(file,), overwrite=True) as staging:
        convert_to_checkpoint(file, staging)
    return target


def _reader(file: Path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise TesselError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    try:
        return GGUFReader(str(file))
    except (ValueError, OSError, KeyError, IndexError, TypeError, OverflowError, struct.error) as error:
        raise TesselError(f"{file} is not a readable GGUF file: {error}") from None


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise TesselError(f"GGUF metadata lacks {key!r}; tessel reads Llama-architecture GGUF files")
        return default
    return field.contents()


def hf_config(reader, has_output: bool) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise TesselError(
            f"GGUF general.architecture = {arch!r} is not supported; tessel reads {', '.join(ARCHITECTURES)}"
        )
    architecture, model_type = ARCHITECTURES[arch]
    scaling = reader.fields.get(f"{arch}.rope.scaling.type")
    if scaling is not None and not (arch == "gemma3" and scaling.contents() == "linear"):
        raise TesselError(f"GGUF {arch}.rope.scaling.type is not supported")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise TesselError("the GGUF file has no token_embd.weight tensor; is it a decoder model?")
    head_dim = _field(reader, f"{arch}.attention.key_length", 0) or _field(
        reader, f"{arch}.rope.dimension_count", hidden // heads
    )
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": _ffn_width(reader, arch),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(embd.shape[-1]),
        "tie_word_embeddings": not has_output,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "torch_dtype": "float32",
    }
    if arch == "gemma3":
        del config["hidden_act"]
        config |= _gemma3_config(reader, config)
    if arch in MOE_RENORMALISES and _field(reader, f"{arch}.expert_count", 0):
        config |= _moe_config(reader, arch, config)
    return config


def _moe_config(reader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """Experts: a `llama` file with experts is a Mixtral; Qwen2-MoE adds a shared expert."""
    out = {
        "num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count")),
        "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm", MOE_RENORMALISES[arch])),
    }
    experts = int(_field(reader, f"{arch}.expert_count"))
    if arch == "llama":
        return out | {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": experts,
        }
    width = int(_field(reader, f"{arch}.expert_feed_forward_length"))
    routed = {t.name for t in reader.tensors}  # a layer without a router is dense (mlp_only_layers)
    out |= {
        "num_experts": experts,
        "moe_intermediate_size": width,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [
            i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in routed
        ],
    }
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(
            _field(reader, f"{arch}.expert_shared_feed_forward_length")
        )
    return out


def _ffn_width(reader, arch: str) -> int:
    """The dense MLP's width; an MoE file may give only its experts'."""
    if reader.fields.get(f"{arch}.feed_forward_length") is None:
        return int(_field(reader, f"{arch}.expert_feed_forward_length"))
    return int(_field(reader, f"{arch}.feed_forward_length"))


def _gemma3_config(reader, config: dict[str, Any]) -> dict[str, Any]:
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    scalar = hidden // heads if layers == GEMMA3_27B_LAYERS else config["head_dim"]
    types = [
        "sliding_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN else "full_attention" for i in range(layers)
    ]
    out = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(_field(reader, "gemma3.attention.sliding_window")),
        "layer_types": types,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
    }
    factor = reader.fields.get("gemma3.rope.scaling.factor")
    if factor is not None:
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor.contents())}
    return out


def q8_0_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 GGUF tensor -> (int8 [rows, cols], float32 scales [rows, cols / 32])."""
    raw = np.asarray(tensor.data, dtype=np.uint8)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q8_0_BYTES)
    scales = blocks[:, :, :2].copy().view(np.float16).reshape(rows, -1).astype(np.float32)
    q = blocks[:, :, 2:].copy().view(np.int8)
    zero = scales == 0  # llama.cpp's d = 0 for an all-zero block: codes 0 at scale 1 are the same zeros
    q[zero], scales[zero] = 0, 1.0  # (the loader refuses scales <= 0)
    return torch.from_numpy(q.reshape(rows, -1)), torch.from_numpy(scales)


def _dequantized(tensor) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = np.asarray(tensor.data, dtype=np.float32)
    else:
        values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a writable copy


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (transformers' reverse_permute_weights)."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _hf_name(name: str, arch: str = "llama") -> tuple[str, str | None]:
    """GGUF tensor name -> (HF name, GGUF layer-tensor kind or None)."""
    base, _, suffix = name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{suffix}", None
    parts = base.split(".")
    names = GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in EXPERT_STACKS:  # split by write_weights
        return f"model.layers.{parts[1]}.mlp.experts", parts[2]
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}", parts[2]
    raise TesselError(f"GGUF tensor {name!r} is not one tessel knows for a {arch} model")


def convert_to_checkpoint(file: Path, out: Path) -> None:
    """`file` as the checkpoint directory `out`: config, weights (float, or W8A16 for an all-Q8_0
    Llama) and tokenizer."""
    write_weights(_reader(file), out)
    _save_tokenizer(file, out)


def _header_shapes(reader, config: dict[str, Any], arch: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF name -> (GGUF name, shape) of every tensor as the file's header declares it (a stacked expert
    tensor as each expert's), with the renames `write_weights` makes; no tensor data is read."""
    mixtral = config["model_type"] == "mixtral"
    out = {}
    for tensor in reader.tensors:
        hf, kind = _hf_name(tensor.name, arch)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the fastest dimension first
        if kind in EXPERT_STACKS:
            proj = EXPERT_STACKS[kind]
            prefix = hf.replace(".mlp.", ".block_sparse_moe.") if mixtral else hf
            proj = MIXTRAL_PROJ[proj] if mixtral else proj
            out |= {f"{prefix}.{e}.{proj}.weight": (tensor.name, shape[1:]) for e in range(shape[0])}
            continue
        if kind == "ffn_gate_inp_shexp":
            shape = (1, *shape)
        if mixtral and kind == "ffn_gate_inp":
            hf = hf.replace(".mlp.", ".block_sparse_moe.")
        out[hf] = (tensor.name, shape)
    return out


def _readable_type(tensor_type) -> bool:
    from gguf import GGMLQuantizationType
    from gguf.quants import _type_traits  # the block types gguf's `dequantize` implements

    return tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or tensor_type in _type_traits


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """What a GGUF file's header says, read without any tensor data: the HF config its metadata
    implies, each tensor's HF name -> (GGUF name, shape), and the tensors of types tessel cannot
    de-quantise ((GGUF name, type name))."""

    config: dict[str, Any]
    shapes: dict[str, tuple[str, tuple[int, ...]]]
    unreadable: list[tuple[str, str]]


def read_header(file: Path) -> GGUFHeader:
    """The header of GGUF `file` (the model reader holds it against the metadata before converting)."""
    reader = _reader(file)
    config = hf_config(reader, "output.weight" in {t.name for t in reader.tensors})
    arch = _field(reader, "general.architecture")
    unreadable = [(t.name, t.tensor_type.name) for t in reader.tensors if not _readable_type(t.tensor_type)]
    return GGUFHeader(config, _header_shapes(reader, config, arch), unreadable)


def write_weights(reader, out: Path) -> None:
    """config.json and model.safetensors of the GGUF file `reader` reads, into directory `out`."""
    from gguf import GGMLQuantizationType
    from safetensors.torch import save_file

    names = {t.name for t in reader.tensors}
    config = hf_config(reader, "output.weight" in names)
    arch = _field(reader, "general.architecture")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    heads = heads if arch == "llama" else {}  # only convert_hf_to_gguf's LlamaModel permutes
    linears = [t for t in reader.tensors if _hf_name(t.name, arch)[1] in LINEARS]
    keep_int8 = config["model_type"] == "llama" and bool(linears)
    keep_int8 = keep_int8 and all(t.tensor_type == GGMLQuantizationType.Q8_0 for t in linears)
    scheme = Scheme("w8a16", 8, Q8_0_BLOCK, None)
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        hf, kind = _hf_name(tensor.name, arch)
        if keep_int8 and kind in LINEARS:
            q, scale = q8_0_blocks(tensor)
            if kind in heads:
                q, scale = _unpermute(q, heads[kind]), _unpermute(scale, heads[kind])
            prefix = hf.removesuffix(".weight")
            for leaf, value in module_tensors(scheme, QuantizedWeight(q, scale, Q8_0_BLOCK)).items():
                tensors[f"{prefix}.{leaf}"] = value
            continue
        value = _dequantized(tensor)
        if kind in EXPERT_STACKS:
            tensors |= _experts(hf, EXPERT_STACKS[kind], value, config["model_type"] == "mixtral")
            continue
        if kind == "ffn_gate_inp_shexp":
            value = value.reshape(1, -1)  # llama.cpp keeps the shared expert's gate as a vector
        if config["model_type"] == "mixtral" and kind == "ffn_gate_inp":
            hf = hf.replace(".mlp.", ".block_sparse_moe.")
        if kind in heads:
            value = _unpermute(value, heads[kind])
        if arch == "gemma3" and hf.endswith("norm.weight"):
            value = value - 1.0  # llama.cpp stored Gemma's (1 + w)
        tensors[hf] = value.contiguous()
    if keep_int8:
        config["quantization_config"] = quantization_config(scheme)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})


def _experts(prefix: str, proj: str, stacked: torch.Tensor, mixtral: bool) -> dict[str, torch.Tensor]:
    """A stacked expert projection [E, rows, cols] as each expert's HF tensor (Mixtral: w1/w3/w2 of
    `block_sparse_moe`)."""
    if mixtral:
        prefix, proj = prefix.replace(".mlp.", ".block_sparse_moe."), MIXTRAL_PROJ[proj]
    return {f"{prefix}.{e}.{proj}.weight": stacked[e].contiguous() for e in range(stacked.shape[0])}


def _save_tokenizer(file: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except (OSError, ValueError, KeyError) as error:
        raise TesselError(f"cannot read the tokenizer of {file}: {error}") from None
    tokenizer.save_pretrained(str(out))
