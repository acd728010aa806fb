"""BERT config.json fields (post-norm encoders), read without torch: the engine's loader
(`tessel.models.bert`) and the cost model (`tessel.catalog.models`) both go through `BertConfig`.

    config = BertConfig.from_dir("/models/all-MiniLM-L6-v2")
    encoder_architecture(fields)        # "BertModel", ... or None for a decoder's config.json
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tessel.catalog.hf_config import MAX_LAYERS, ConfigFields, read_json_object
from tessel.errors import TesselError

ENCODER_ARCHITECTURES = (
    "BertModel",
    "BertForMaskedLM",
    "BertForPreTraining",
    "BertForSequenceClassification",
)
ENCODER_MODEL_TYPES = ("bert",)
# hidden_act -> the activation HF's ACT2FN applies ("gelu" is the exact erf form)
ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
DEFAULT_LAYER_NORM_EPS = 1e-12  # BertConfig's default


@dataclass(frozen=True, slots=True)
class BertConfig:
    """The fields of a BERT config.json the encoder needs, validated (`from_dict`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = DEFAULT_LAYER_NORM_EPS
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    checkpoint_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise TesselError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise TesselError(
                f"hidden_act {self.hidden_act!r} is not supported; BERT encoders run {', '.join(ACTIVATIONS)}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, data: dict, source: str = "config.json") -> BertConfig:
        fields = ConfigFields(data, source)
        kind = fields.text("position_embedding_type", "absolute")
        if kind != "absolute":
            raise TesselError(
                f"{source}: position_embedding_type {kind!r} is not supported (only absolute positions)"
            )
        try:
            return cls(
                architecture=encoder_architecture(data) or "BertModel",
                vocab_size=fields.count("vocab_size"),
                hidden_size=fields.count("hidden_size"),
                num_hidden_layers=fields.count("num_hidden_layers", high=MAX_LAYERS),
                num_attention_heads=fields.count("num_attention_heads"),
                intermediate_size=fields.count("intermediate_size"),
                max_position_embeddings=fields.count("max_position_embeddings", default=512),
                type_vocab_size=fields.count("type_vocab_size", default=2),
                layer_norm_eps=fields.positive_float("layer_norm_eps", DEFAULT_LAYER_NORM_EPS),
                hidden_act=fields.text("hidden_act", "gelu"),
                pad_token_id=fields.token_id("pad_token_id") or 0,
                checkpoint_dtype=str(data.get("torch_dtype") or data.get("dtype") or "float32"),
            )
        except TesselError as error:
            message = str(error)
            raise TesselError(message if message.startswith(source) else f"{source}: {message}") from None

    @classmethod
    def from_dir(cls, path: Path) -> BertConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise TesselError(f"{path} has no config.json; point --model at a Hugging Face model directory")
        return cls.from_dict(read_json_object(config_file), source=str(config_file))


def encoder_architecture(data: dict) -> str | None:
    """The BERT architecture a parsed config.json names (its `architectures`, else `model_type`), or None."""
    names = data.get("architectures")
    if isinstance(names, list):
        for name in names:
            if name in ENCODER_ARCHITECTURES:
                return name
        if names:
            return None
    return "BertModel" if data.get("model_type") in ENCODER_MODEL_TYPES else None
