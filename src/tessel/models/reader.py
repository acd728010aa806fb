"""The one model reader: every command that opens a model checks it here before any heavy work.

    model = read_model("/models/Llama-3.2-1B")       # or a .gguf file, converted once (gguf_import)
    model.config, model.scheme, model.files, model.tensors

`read_model` resolves the path (a Hugging Face directory, or a .gguf file's checkpoint directory),
reads config.json through the one config reader (`tessel.catalog.hf_config` via `ModelConfig`,
which also has transformers' config class read it, as every tokenizer does), reads every
safetensors header (`tessel.models.safetensors_header`: sizes consistent with the file) and checks
that the weights are the model config.json describes: each layer it counts exists on disk, every
tensor it implies is there with the shape its sizes imply and a dtype tessel reads, nothing else
is. Sizes are thereby bounded by the bytes on disk before anything is allocated (a config.json
claiming 10^9 layers or a 10^12-token vocabulary against a small file is refused, not built); the
rotary tables, the one size not stored, are held to the same bound.

Generate, serve, `tessel.LLM` and the pipeline stages reach it through `tessel.models.loader`;
quantize, qat and sensitivity through `tessel.quant.calibrate`; the CLI through
`tessel.commands.options.check_model_path`; `tessel launch` through the worker's `validate`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tessel.catalog.hf_arch import RUNNABLE_ARCHITECTURES
from tessel.errors import TesselError
from tessel.models.config import ModelConfig
from tessel.models.quantized.schemes import Scheme
from tessel.models.safetensors_header import SAFETENSORS_FLOAT_DTYPES, TensorHeader, read_header

if TYPE_CHECKING:
    from tessel.models.bert import BertConfig

INDEX_FILE = "model.safetensors.index.json"
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry; recomputed
LAYER_PREFIX = "model.layers."
ROPE_TABLE_FLOOR_BYTES = 256 * 2**20  # rotary tables always allowed up to this (4M positions at head_dim 16)
ROPE_TABLE_BYTES_PER_VALUE = 4  # float32 cos and sin, head_dim / 2 values each per position
INT_DTYPES = frozenset({"I32", "I64"})
QUANTISED_ARCHITECTURES = RUNNABLE_ARCHITECTURES  # `tessel.quant.layer_map` maps every one


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What config.json implies for one checkpoint tensor; `sizes` names the fields behind the shape."""

    shape: tuple[int, ...]
    dtypes: frozenset[str]
    sizes: str
    required: bool = True
    any_layout: bool = False  # scales: [N, groups] or flat; only the element count must match


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A model directory checked against its config: what every command gets before loading."""

    path: Path  # the checkpoint directory (for a .gguf file: its converted copy)
    config: ModelConfig
    scheme: Scheme | None  # a compressed-tensors checkpoint's scheme; None for float weights
    files: tuple[Path, ...]
    tensors: dict[str, TensorHeader]

    @property
    def weight_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors.values())


def read_model(path: str | Path, option: str = "--model") -> ModelFiles:
    """The model at `path` (a Hugging Face directory or a .gguf file), checked; TesselError names the
    file and the field. An encoder (BERT) is refused here: it is read by `read_encoder`."""
    directory = resolve_model_dir(path, option)
    if is_encoder_model(directory):
        raise TesselError(
            f"{option} {directory} is an encoder (BERT) model: it computes embeddings, not text; use "
            "`tessel embed`, or `tessel serve`, which answers /v1/embeddings for it"
        )
    config = ModelConfig.from_dir(directory)
    scheme = read_scheme(directory)
    if scheme is not None and config.architecture not in QUANTISED_ARCHITECTURES:
        raise TesselError(
            f"{directory}: a quantised {config.architecture} checkpoint is not supported yet "
            f"(quantised checkpoints run for {', '.join(QUANTISED_ARCHITECTURES)}); use its float weights"
        )
    files = tuple(checkpoint_files(directory))
    tensors = read_headers(files)
    check_tensors(directory, config, scheme, tensors)
    model = ModelFiles(directory, config, scheme, files, tensors)
    check_rope_tables(model)
    return model


def is_checkpoint(path: str | Path) -> bool:
    """A .gguf file, or a directory holding safetensors weights (not just a config.json)."""
    path = Path(path)
    if path.is_dir():
        return (path / INDEX_FILE).is_file() or any(path.glob("*.safetensors"))
    return path.suffix.lower() == ".gguf" and path.is_file()


def resolve_model_dir(path: str | Path, option: str = "--model") -> Path:
    """A model directory as given, or the checkpoint directory a .gguf file converts to (cached)."""
    from tessel.models.gguf import resolve_model_path

    path = Path(path)
    is_gguf = path.suffix.lower() == ".gguf" and path.is_file()
    if not (is_gguf or path.is_dir()):
        raise TesselError(
            f"{option} {path} is not a directory or a .gguf file; give a local Hugging Face model directory"
        )
    if is_gguf:
        check_gguf_header(path)
    return resolve_model_path(path)


def check_gguf_header(file: Path) -> None:
    """Every tensor's type and shape in a GGUF file's header against what tessel reads and what the
    file's metadata implies (`expected_tensors`), before any tensor is de-quantised: a mismatch is a
    user error naming the tensor (and the metadata behind the expected shape)."""
    from tessel.models.gguf import read_header

    header = read_header(file)
    for name, kind in header.unreadable:
        raise TesselError(
            f"GGUF tensor {name!r} is stored as {kind}, not a weight type tessel de-quantises "
            "(F32, F16, BF16 and the gguf package's block types)"
        )
    expected = expected_tensors(ModelConfig.from_dict(header.config, "the GGUF metadata"), None)
    for hf, (name, shape) in header.shapes.items():
        spec = expected.get(hf)
        if spec is None:
            raise TesselError(
                f"GGUF tensor {name!r} holds {hf!r}, which its metadata does not imply (expert_count, "
                "block_count?); the file is damaged or not the model its metadata describes"
            )
        if shape != spec.shape:
            raise TesselError(
                f"GGUF tensor {name!r} has shape {list(shape)}, its metadata implies {list(spec.shape)} "
                f"({spec.sizes}); the file is damaged or not the model its metadata describes"
            )


def read_scheme(directory: Path) -> Scheme | None:
    """The quantisation scheme config.json declares (None: float weights); its errors name the file."""
    from tessel.catalog.hf_config import read_json_object
    from tessel.models.quantized.compressed_tensors import parse_quantization_config

    config_file = directory / "config.json"
    try:
        return parse_quantization_config(read_json_object(config_file))
    except TesselError as error:
        message = str(error)
        located = message if message.startswith(str(config_file)) else f"{config_file}: {message}"
        raise TesselError(located) from None


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a directory: its index's shards, model.safetensors, or every *.safetensors."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({path / name for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
            raise TesselError(
                f"{index}: not a readable safetensors index ({error}); re-save the checkpoint"
            ) from None
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise TesselError(
            f"{path} has no .safetensors weights; tessel loads safetensors only "
            "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))"
        )
    outside = [str(f) for f in files if f.parent != path]
    if outside:
        raise TesselError(f"{index}: shards must be files of {path}, not {', '.join(outside[:3])}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise TesselError(f"{path}: shard(s) listed in {INDEX_FILE} are missing: {', '.join(missing)}")
    return files


def read_headers(files: Iterable[Path]) -> dict[str, TensorHeader]:
    """Every tensor's header over all the files; a tensor stored twice is refused."""
    tensors: dict[str, TensorHeader] = {}
    for file in files:
        for name, header in read_header(file).items():
            if name in tensors:
                raise TesselError(f"{file}: tensor {name!r} is also in {tensors[name].file.name}")
            tensors[name] = header
    return tensors


def check_tensors(
    directory: Path, config: ModelConfig, scheme: Scheme | None, tensors: dict[str, TensorHeader]
) -> None:
    """The weights hold exactly the tensors config.json implies (layers first: no huge enumeration)."""
    check_layer_count(directory, config, tensors)
    expected = expected_tensors(config, scheme)
    missing = [name for name, spec in expected.items() if spec.required and name not in tensors]
    if missing:
        raise TesselError(
            f"{directory}: the checkpoint lacks {len(missing)} tensor(s) config.json implies, "
            f"e.g. {', '.join(missing[:5])}"
        )
    for name, header in tensors.items():
        spec = expected.get(name)
        if spec is None:
            if name.endswith(SKIPPED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
                continue
            raise TesselError(
                f"{header.file}: unexpected tensor {name!r}; is this really a {config.architecture} "
                "with the sizes in its config.json?"
            )
        _check_tensor(header, spec)


def _check_tensor(header: TensorHeader, spec: TensorSpec) -> None:
    if header.dtype not in spec.dtypes:
        raise TesselError(
            f"{header.file}: tensor {header.name!r} is {header.dtype}; tessel reads it as "
            f"{' or '.join(sorted(spec.dtypes))}"
        )
    fits = math.prod(header.shape) == math.prod(spec.shape) if spec.any_layout else header.shape == spec.shape
    if not fits:
        raise TesselError(
            f"{header.file}: tensor {header.name!r} has shape {list(header.shape)}, config.json implies "
            f"{list(spec.shape)} ({spec.sizes})"
        )


def check_layer_count(directory: Path, config: ModelConfig, tensors: dict[str, TensorHeader]) -> None:
    """num_hidden_layers against the layers on disk, before any per-layer work."""
    on_disk = set()
    for name in tensors:
        if name.startswith(LAYER_PREFIX):
            index = name[len(LAYER_PREFIX) :].split(".", 1)[0]
            if index.isascii() and index.isdigit():
                on_disk.add(int(index))
    wanted = config.num_hidden_layers
    if wanted > len(on_disk):
        held = f"layers 0-{max(on_disk)}" if on_disk else "no decoder layer"
        raise TesselError(
            f"{directory / 'config.json'}: num_hidden_layers is {wanted}, but the weights hold "
            f"{len(on_disk)} ({held}); fix config.json or re-download the checkpoint"
        )


@dataclass(frozen=True, slots=True)
class _Linear:
    """One decoder-layer linear as config.json sizes it: [rows, cols] named by the fields behind them."""

    rows: int
    row_fields: str
    cols: int
    col_fields: str
    biased: bool
    quantised: bool = True  # False: stays float in a quantised checkpoint (MoE routers)


def expected_tensors(config: ModelConfig, scheme: Scheme | None) -> dict[str, TensorSpec]:
    """Checkpoint (Hugging Face) name -> what config.json implies for it."""
    c = config
    hidden = (c.hidden_size, "hidden_size")
    embedding = TensorSpec(
        (c.vocab_size, c.hidden_size), SAFETENSORS_FLOAT_DTYPES, "vocab_size x hidden_size"
    )
    out = {
        "model.embed_tokens.weight": embedding,
        "model.norm.weight": TensorSpec((c.hidden_size,), SAFETENSORS_FLOAT_DTYPES, hidden[1]),
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = embedding
    for i in range(c.num_hidden_layers):
        prefix = f"{LAYER_PREFIX}{i}."
        for norm in _layer_norms(c):
            out[f"{prefix}{norm}.weight"] = TensorSpec((c.hidden_size,), SAFETENSORS_FLOAT_DTYPES, hidden[1])
        for norm in ("self_attn.q_norm", "self_attn.k_norm") if c.qk_norm else ():
            out[f"{prefix}{norm}.weight"] = TensorSpec((c.head_dim,), SAFETENSORS_FLOAT_DTYPES, "head_dim")
        for leaf, linear in _layer_linears(c, i).items():
            name = f"{prefix}{leaf}"
            quantised = linear.quantised and scheme is not None and name not in scheme.float_linears
            out |= _linear_tensors(name, linear, scheme if quantised else None)
    return out


def _layer_norms(c: ModelConfig) -> tuple[str, ...]:
    norms = ("input_layernorm", "post_attention_layernorm")
    return (*norms, "pre_feedforward_layernorm", "post_feedforward_layernorm") if c.gemma else norms


def _layer_linears(c: ModelConfig, index: int) -> dict[str, _Linear]:
    """Layer `index`'s linears by checkpoint name: attention (Phi-3: fused qkv), then the MLP or the
    experts of an MoE layer."""
    hidden = (c.hidden_size, "hidden_size")
    q = (c.q_size, "num_attention_heads x head_dim")
    kv = (c.kv_size, "num_key_value_heads x head_dim")
    if c.fused_checkpoint:
        qkv = (c.q_size + 2 * c.kv_size, "(num_attention_heads + 2 num_key_value_heads) x head_dim")
        out = {"self_attn.qkv_proj": _Linear(*qkv, *hidden, c.qkv_bias)}
    else:
        out = {
            name: _Linear(*rows, *hidden, c.qkv_bias)
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
        }
        out = {f"self_attn.{name}": linear for name, linear in out.items()}
    out["self_attn.o_proj"] = _Linear(*hidden, *q, c.o_bias)
    if not c.is_moe_layer(index):
        return out | _mlp_linears("mlp", c, (c.intermediate_size, "intermediate_size"))
    block = "block_sparse_moe" if c.architecture == "MixtralForCausalLM" else "mlp"
    out[f"{block}.gate"] = _Linear(c.num_experts, "num_experts", *hidden, False, quantised=False)
    width = (c.moe_intermediate_size, "moe_intermediate_size")
    names = ("w1", "w3", "w2") if block == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj")
    for e in range(c.num_experts):
        out |= _mlp_linears(f"{block}.experts.{e}", c, width, names, biased=False)
    if c.shared_expert_intermediate_size:
        shared = (c.shared_expert_intermediate_size, "shared_expert_intermediate_size")
        out |= _mlp_linears("mlp.shared_expert", c, shared, biased=False)
        out["mlp.shared_expert_gate"] = _Linear(1, "one gate", *hidden, False, quantised=False)
    return out


def _mlp_linears(
    prefix: str,
    c: ModelConfig,
    width: tuple[int, str],
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    biased: bool | None = None,
) -> dict[str, _Linear]:
    hidden = (c.hidden_size, "hidden_size")
    bias = c.mlp_bias if biased is None else biased
    if c.fused_checkpoint:
        return {
            f"{prefix}.gate_up_proj": _Linear(2 * width[0], f"2 {width[1]}", *hidden, bias),
            f"{prefix}.down_proj": _Linear(*hidden, *width, bias),
        }
    gate, up, down = names
    return {
        f"{prefix}.{gate}": _Linear(*width, *hidden, bias),
        f"{prefix}.{up}": _Linear(*width, *hidden, bias),
        f"{prefix}.{down}": _Linear(*hidden, *width, bias),
    }


def _linear_tensors(prefix: str, linear: _Linear, scheme: Scheme | None) -> dict[str, TensorSpec]:
    """One linear's tensors: float `weight`, or a compressed-tensors layout
    (`tessel.models.quantized.compressed_tensors`)."""
    n, k, rows = linear.rows, linear.cols, linear.row_fields
    sizes = f"{rows}, {linear.col_fields}"
    bias = TensorSpec((n,), SAFETENSORS_FLOAT_DTYPES, rows, required=linear.biased and scheme is None)
    if scheme is None:  # a bias config.json does not imply is unexpected, as the loader has no place for it
        weight = {f"{prefix}.weight": TensorSpec((n, k), SAFETENSORS_FLOAT_DTYPES, sizes)}
        return weight | {f"{prefix}.bias": bias} if linear.biased else weight
    group = scheme.group_size
    if group is not None and k % group:
        raise TesselError(
            f"{prefix}: quantization_config group_size {group} does not divide its {k} input features"
        )
    groups = 1 if group is None else k // group
    out = {
        f"{prefix}.bias": bias,
        f"{prefix}.weight_scale": TensorSpec(
            (n, groups), SAFETENSORS_FLOAT_DTYPES, f"{rows}, groups", any_layout=True
        ),
    }
    if not scheme.weight_only:
        out[f"{prefix}.weight"] = TensorSpec((n, k), frozenset({"I8"}), sizes)
        out[f"{prefix}.input_scale"] = TensorSpec(
            (1,), SAFETENSORS_FLOAT_DTYPES, "one scale", required=scheme.act_static, any_layout=True
        )
        return out
    bits = scheme.weight_bits
    out[f"{prefix}.weight_packed"] = TensorSpec(
        (n, -(-k * bits // 32)), frozenset({"I32"}), f"{sizes} at {bits} bits per int32"
    )
    out[f"{prefix}.weight_shape"] = TensorSpec((2,), INT_DTYPES, "[rows, cols]")
    out[f"{prefix}.weight_zero_point"] = TensorSpec(
        (-(-n * bits // 32), groups),
        frozenset({"I32"}),
        f"{rows} packed, groups",
        required=not scheme.symmetric,
    )
    return out


def check_rope_tables(model: ModelFiles) -> None:
    """The rotary cos/sin tables (max_position_embeddings x head_dim float32) within the weights' bound."""
    c = model.config
    table_bytes = c.max_position_embeddings * c.head_dim * ROPE_TABLE_BYTES_PER_VALUE
    limit = max(model.weight_bytes, ROPE_TABLE_FLOOR_BYTES)
    if table_bytes > limit:
        raise TesselError(
            f"{model.path / 'config.json'}: max_position_embeddings {c.max_position_embeddings} needs "
            f"{table_bytes / 2**30:.1f} GiB of rotary tables at head_dim {c.head_dim}, above the "
            f"{limit / 2**30:.2f} GiB allowed beside {model.weight_bytes / 2**30:.2f} GiB of weights; "
            "fix max_position_embeddings"
        )


# ---- encoders (BERT): the same checks, against the tensors `tessel.models.bert` implies ------------


@dataclass(frozen=True, slots=True)
class EncoderFiles:
    """An encoder directory checked against its config.json (`read_encoder`)."""

    path: Path
    config: BertConfig
    files: tuple[Path, ...]
    tensors: dict[str, TensorHeader]


def is_encoder_model(path: str | Path) -> bool:
    """Whether `path` is a directory whose config.json names a BERT encoder (unreadable: False, so the
    decoder reader reports what is wrong with it)."""
    from tessel.models.bert import encoder_architecture

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return False
    try:
        from tessel.catalog.hf_config import read_json_object

        return encoder_architecture(read_json_object(config_file)) is not None
    except TesselError:
        return False


def read_encoder(path: str | Path, option: str = "--model") -> EncoderFiles:
    """The encoder at `path`, checked: every tensor config.json implies is there with its shape and a
    float dtype, nothing unknown is (task heads, the pooler and position ids are allowed and skipped)."""
    from tessel.models.bert import BertConfig, checkpoint_prefix, expected_shapes, is_ignored

    directory = resolve_model_dir(path, option)
    if not is_encoder_model(directory):
        raise TesselError(
            f"{option} {directory} is not an encoder model (config.json names no BERT architecture); "
            "embeddings come from BERT-family encoders such as sentence-transformers checkpoints"
        )
    config = BertConfig.from_dir(directory)
    files = tuple(checkpoint_files(directory))
    tensors = read_headers(files)
    prefix = checkpoint_prefix(list(tensors))
    shapes = expected_shapes(config)
    expected = {
        prefix + name: TensorSpec(shape, SAFETENSORS_FLOAT_DTYPES, sizes)
        for name, (shape, sizes) in shapes.items()
    }
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise TesselError(
            f"{directory}: the checkpoint lacks {len(missing)} tensor(s) config.json implies, "
            f"e.g. {', '.join(missing[:5])}"
        )
    for name, header in tensors.items():
        if name in expected:
            _check_tensor(header, expected[name])
        elif not is_ignored(name, prefix):
            raise TesselError(
                f"{header.file}: unexpected tensor {name!r}; is this really a {config.architecture} "
                "with the sizes in its config.json?"
            )
    return EncoderFiles(directory, config, files, tensors)
