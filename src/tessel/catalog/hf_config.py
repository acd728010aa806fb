"""The one reader of Hugging Face `config.json` files: the catalog and the engine both go through it.

    config = read_hf_config("/models/Llama-3.1-8B")            # a directory or its config.json
    config = parse_hf_config(fields, source="preset llama-3-8b")  # fields already parsed

Every field is checked once here: counts are whole numbers in [1, MAX_COUNT]; the head count
divides the hidden size unless `head_dim` is given; KV heads divide the heads; rope scaling is
one of ROPE_TYPES. transformers 5 writes `rope_parameters` (holding `rope_theta` and the scaling),
4.x writes `rope_theta` and `rope_scaling`; both are read. A bad file or field raises TesselError
naming the file and the field. Pure Python: the catalog must import without torch.
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessel.catalog import hf_arch
from tessel.errors import TesselError

# HF architecture name -> model family; `model_type` is the fallback when `architectures` is missing.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "OPTForCausalLM": "opt",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3_text",
}
ROPE_TYPES = ("default", "linear", "llama3")  # what tessel.layers.rotary computes
MAX_COUNT = 2**31 - 1  # sizes and counts index int32 tensors in the engine's kernels
# The deepest decoders published have 126 layers (Llama-3.1-405B); the planner prices every layer
# on every device, so a config claiming millions would make `tessel plan` run for hours.
MAX_LAYERS = 4096
MAX_CONFIG_BYTES = 16 * 2**20  # a real config.json is a few KiB
DEFAULT_MAX_POSITIONS = 2048
DEFAULT_RMS_NORM_EPS = 1e-6
DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """HF `rope_scaling` / `rope_parameters` (the scaling part). `rope_type` is one of ROPE_TYPES."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise TesselError(
                f"rope scaling type {self.rope_type!r} is not supported; tessel supports "
                f"{', '.join(ROPE_TYPES)}. Use a model whose config.json has one of those."
            )
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise TesselError(f"rope scaling factor must be a finite number > 0, got {self.factor}")
        if not all(math.isfinite(f) for f in (self.low_freq_factor, self.high_freq_factor)):
            raise TesselError("rope scaling low_freq_factor and high_freq_factor must be finite")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise TesselError("llama3 rope scaling needs high_freq_factor > low_freq_factor")


@dataclass(frozen=True, slots=True)
class HFConfig:
    """The validated fields of one config.json, in HF's names (`family` is the model family)."""

    source: str
    family: str  # a value of ARCHITECTURES
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # OPT: `ffn_dim`
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    hidden_act: str  # OPT: `activation_function`
    rms_norm_eps: float
    rope_theta: float | None  # None for OPT (learned positions)
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    attention_bias: bool  # Llama/Mistral: q/k/v/o biased; Qwen2 biases q/k/v regardless
    mlp_bias: bool
    sliding_window: int | None  # the window the model uses (Qwen2: only with use_sliding_window)
    num_local_experts: int = 1
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0  # one routed expert's MLP width (Mixtral: intermediate_size)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is routed experts (the others dense)
    layer_types: tuple[str, ...] = ()  # per layer: full_attention or sliding_attention (the window)
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma 3)
    local_rope_theta: float | None = None  # Gemma 3: the rope base of sliding-window layers
    query_pre_attn_scalar: float | None = None  # Gemma 3: attention scale is its -1/2 power
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None


def read_hf_config(path: str | Path) -> HFConfig:
    """The config.json of a model directory (or the file itself), validated."""
    path = config_path(path)
    return parse_hf_config(read_json_object(path), source=str(path))


def config_path(path: str | Path) -> Path:
    """`path/config.json` for a directory, `path` itself for a file; TesselError when neither exists."""
    path = Path(path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TesselError(f"{path} has no config.json; give a Hugging Face model directory")
        return path / "config.json"
    if not path.is_file():
        raise TesselError(f"{path}: no such file or directory (want a model directory or its config.json)")
    return path


def read_json_object(path: Path) -> dict:
    """A JSON file whose top level is an object; unreadable, binary or malformed files are user errors."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise TesselError(f"{path}: {size} bytes is too large for a config file")
        raw = path.read_bytes()
    except OSError as error:
        raise TesselError(f"{path}: cannot read ({error.strerror or error})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise TesselError(f"{path}: not a UTF-8 text file; expected a JSON config") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise TesselError(f"{path}: not valid JSON (line {error.lineno}: {error.msg})") from None
    except (RecursionError, ValueError) as error:  # nesting too deep, a number too long to convert
        raise TesselError(f"{path}: not valid JSON ({type(error).__name__}: {error})") from None
    if not isinstance(data, dict):
        raise TesselError(f"{path}: expected a JSON object of config fields, got a JSON {_json_type(data)}")
    return data


def parse_hf_config(data: dict, *, source: str) -> HFConfig:
    """Validate config.json fields (the families of ARCHITECTURES); errors name `source` and the field."""
    if not isinstance(data, dict):
        raise TesselError(f"{source}: expected a JSON object of config fields, got {_json_type(data)}")
    fields = ConfigFields(data, source)
    architecture, family = _architecture(fields)
    common = {
        "source": source,
        "family": family,
        "architecture": architecture,
        "vocab_size": fields.count("vocab_size"),
        "hidden_size": fields.count("hidden_size"),
        "num_hidden_layers": fields.count("num_hidden_layers", high=MAX_LAYERS),
        "num_attention_heads": fields.count("num_attention_heads"),
        "max_position_embeddings": fields.count("max_position_embeddings", default=DEFAULT_MAX_POSITIONS),
        "bos_token_id": fields.token_id("bos_token_id"),
        "eos_token_ids": fields.token_ids("eos_token_id"),
        "torch_dtype": _dtype(fields),
    }
    return HFConfig(**common, **(_opt(fields, common) if family == "opt" else _llama(fields, common)))


def _llama(fields: ConfigFields, common: dict) -> dict:
    """The Llama family's own fields (Qwen2/3, Mistral, Mixtral, Qwen MoE, Phi-3, Gemma 3 spell them
    alike; what only some have is read by `tessel.catalog.hf_arch`)."""
    hidden, heads, source = common["hidden_size"], common["num_attention_heads"], fields.source
    family, layers = common["family"], common["num_hidden_layers"]
    kv_heads = fields.count("num_key_value_heads", default=heads)
    if heads % kv_heads:
        raise TesselError(
            f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    intermediate = fields.count("intermediate_size")
    if family == "gemma3_text":
        rope = hf_arch.gemma3_rope(fields, _rope)
    else:
        theta, scaling = _rope(fields)
        rope = {"rope_theta": theta, "rope_scaling": scaling}
    head_dim = fields.count("head_dim", default=0) or _derived_head_dim(fields, hidden, heads)
    if head_dim % 2:
        raise TesselError(
            f"{source}: head_dim ({head_dim}) must be even: rotary embeddings turn pairs of dimensions"
        )
    out = {
        "intermediate_size": intermediate,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": fields.text("hidden_act", "silu"),
        "rms_norm_eps": fields.positive_float("rms_norm_eps", DEFAULT_RMS_NORM_EPS),
        "tie_word_embeddings": fields.flag("tie_word_embeddings", family == "gemma3_text"),
        "attention_bias": fields.flag("attention_bias", False),
        "mlp_bias": fields.flag("mlp_bias", False),
        **rope,
        **hf_arch.attention_fields(fields, family, layers),
        **hf_arch.moe_fields(fields, family, layers, intermediate),
    }
    return out | hf_arch.family_fields(fields, family)


def _opt(fields: ConfigFields, common: dict) -> dict:
    """OPT: LayerNorm, ReLU MLP of `ffn_dim`, biases (`enable_bias`), learned positions, no GQA."""
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    if fields.count("word_embed_proj_dim", default=hidden) != hidden:
        raise TesselError(
            f"{fields.source}: OPT with word_embed_proj_dim != hidden_size (project_in/out) is not supported"
        )
    if not fields.flag("do_layer_norm_before", True):
        raise TesselError(f"{fields.source}: OPT with do_layer_norm_before=false (OPT-350m) is not supported")
    bias = fields.flag("enable_bias", True)
    return {
        "intermediate_size": fields.count("ffn_dim"),
        "num_key_value_heads": heads,
        "head_dim": _derived_head_dim(fields, hidden, heads),
        "hidden_act": fields.text("activation_function", "relu"),
        "rms_norm_eps": DEFAULT_RMS_NORM_EPS,
        "rope_theta": None,
        "rope_scaling": None,
        "tie_word_embeddings": fields.flag("tie_word_embeddings", True),
        "attention_bias": bias,
        "mlp_bias": bias,
        "sliding_window": None,
    }


class ConfigFields:
    """Typed getters over the raw mapping; each error names the source and the field."""

    def __init__(self, data: dict, source: str) -> None:
        self.data, self.source = data, source

    def get(self, key: str) -> object:
        return self.data.get(key)

    def fail(self, key: str, want: str, value: object) -> TesselError:
        return TesselError(f"{self.source}: field {key!r} must be {want}, got {_show(value)}")

    def count(
        self,
        key: str,
        default: int | None = None,
        low: int = 1,
        mapping: dict | None = None,
        high: int = MAX_COUNT,
    ) -> int:
        value = (self.data if mapping is None else mapping).get(key)
        if value is None:
            if default is None:
                raise TesselError(
                    f"{self.source} is missing or has a bad field: {key!r} is required "
                    "(an HF config.json of a model family tessel reads)"
                )
            return default
        want = f"a whole number in [{low}, {high}]"
        return _whole(value, low, high, lambda: self.fail(key, want, value))

    def flag(self, key: str, default: bool) -> bool:
        return self._typed(key, default, bool, "true or false")

    def text(self, key: str, default: str) -> str:
        return self._typed(key, default, str, "a string")

    def _typed(self, key: str, default: Any, kind: type, want: str) -> Any:
        """The field `key` if it is a `kind`, `default` if it is absent or null, else a user error."""
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, kind):
            raise self.fail(key, want, value)
        return value

    def positive_float(
        self, key: str, default: float, mapping: dict | None = None, label: str | None = None
    ) -> float:
        value = (self.data if mapping is None else mapping).get(key)
        if value is None:
            return default
        error = self.fail(label or key, "a finite number > 0", value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise error
        try:
            number = float(value)
        except OverflowError:
            raise error from None
        if not (math.isfinite(number) and number > 0):
            raise error
        return number

    def settings(self, key: str) -> dict:
        """A flat object of settings (rope_scaling / rope_parameters); {} when absent."""
        value = self.data.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(key, "an object of rope settings", value)
        if any(isinstance(item, dict | list) for item in value.values()):
            raise self.fail(
                key,
                "one flat object of rope settings (per-layer-type and longrope lists are not supported)",
                value,
            )
        return value

    def token_id(self, key: str) -> int | None:
        value = self.data.get(key)
        if value is None:
            return None
        return _whole(value, 0, 2**63 - 1, lambda: self.fail(key, "a token id (a whole number >= 0)", value))

    def token_ids(self, key: str) -> tuple[int, ...]:
        value = self.data.get(key)
        if value is None:
            return ()
        items = value if isinstance(value, list) else [value]
        want = "a token id or a list of token ids"
        return tuple(_whole(v, 0, 2**63 - 1, lambda v=v: self.fail(key, want, v)) for v in items)


def _whole(value: object, low: int, high: int, error) -> int:
    """`value` as an int in [low, high]: an int, or a float with an integral value (4096.0)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise error()
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise error()
    if not low <= value <= high:
        raise error()
    return int(value)


def _architecture(fields: ConfigFields) -> tuple[str, str]:
    """(architecture, family): the first architecture tessel knows, else the `model_type`'s."""
    names = fields.get("architectures")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise fields.fail("architectures", "a list of architecture names", names)
    model_type = fields.text("model_type", "")  # transformers reads it too, to pick its classes
    for name in names or []:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
    if names:
        raise TesselError(f"{fields.source}: architecture {names[0]!r} is not supported; {_known()}")
    by_type = {family: name for name, family in ARCHITECTURES.items()}
    if model_type in by_type:
        return by_type[model_type], model_type
    raise TesselError(
        f"{fields.source}: names no architecture tessel knows (model_type {_show(model_type)}); {_known()}"
    )


def _known() -> str:
    runnable = ", ".join(hf_arch.RUNNABLE_ARCHITECTURES)
    return f"tessel runs {runnable} (`{hf_arch.LIST_RUNNABLE}`); the planner also reads OPTForCausalLM"


def _derived_head_dim(fields: ConfigFields, hidden: int, heads: int) -> int:
    if hidden % heads:
        raise TesselError(
            f"{fields.source}: hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads}) "
            "unless head_dim is given"
        )
    return hidden // heads


def _rope(fields: ConfigFields) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5 `rope_parameters` or 4.x `rope_theta` + `rope_scaling`."""
    scaling, params = fields.settings("rope_scaling"), fields.settings("rope_parameters")
    merged = scaling | params  # rope_parameters wins where both name a value
    if "rope_theta" in params:
        theta = fields.positive_float("rope_theta", DEFAULT_ROPE_THETA, params, "rope_parameters.rope_theta")
    else:
        theta = fields.positive_float("rope_theta", DEFAULT_ROPE_THETA)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        raise fields.fail(
            "rope_type", f"one of {', '.join(ROPE_TYPES)} (yarn etc. are not supported)", rope_type
        )
    if rope_type == "default":
        return theta, None
    settings: dict[str, float | int] = {}
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
        if merged.get(name) is not None:
            settings[name] = fields.positive_float(name, 1.0, merged)
    key = "original_max_position_embeddings"
    if merged.get(key) is not None:
        settings[key] = fields.count(key, mapping=merged)
    try:
        return theta, RopeScaling(rope_type=rope_type, **settings)
    except TesselError as error:
        raise TesselError(f"{fields.source}: {error}") from None


def _dtype(fields: ConfigFields) -> str | None:
    value = fields.get("torch_dtype") if fields.get("torch_dtype") is not None else fields.get("dtype")
    if value is not None and not isinstance(value, str):
        raise fields.fail("torch_dtype", "a dtype name such as bfloat16", value)
    return value


def _json_type(value: object) -> str:
    names = {list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


class _ShortRepr(reprlib.Repr):
    """reprlib with integers shown by size past 64 bits (repr of a 5000-digit int raises)."""

    def repr_int(self, value: int, level: int) -> str:
        if value.bit_length() > 64:
            return f"<an integer of {value.bit_length()} bits>"
        return super().repr_int(value, level)


_SHORT = _ShortRepr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 2, 60, 60, 40


def _show(value: object) -> str:
    """A short repr of a (possibly huge or deeply nested) JSON value for an error message."""
    return _SHORT.repr(value)


def read_generation_eos(path: Path) -> tuple[int, ...]:
    """`eos_token_id` of a generation_config.json: HF `generate` stops at these too."""
    return ConfigFields(read_json_object(path), str(path)).token_ids("eos_token_id")
