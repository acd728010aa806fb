"""Pooling and normalisation as a sentence-transformers checkpoint configures them.

A sentence-transformers directory lists its modules in `modules.json`: the Transformer (path ""),
a `Pooling` module whose folder holds `config.json` (`pooling_mode_cls_token`,
`pooling_mode_mean_tokens`, `pooling_mode_max_tokens`, `pooling_mode_mean_sqrt_len_tokens`,
`pooling_mode_lasttoken`; several set: their vectors concatenated in that order, as
sentence-transformers does), and optionally `Normalize` (unit L2 norm). `sentence_bert_config.json`
gives `max_seq_length` and `do_lower_case`. Other modules (`Dense`, ...) are refused by name.

A plain Hugging Face BERT directory (no `modules.json`) gets mean pooling without normalisation:
what sentence-transformers builds for a bare transformers model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tessel.catalog.hf_config import read_json_object
from tessel.errors import TesselError

ST_PREFIX = "sentence_transformers.models."
KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")
# The order sentence-transformers concatenates pooled vectors in (Pooling.forward)
POOLING_MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens", "lasttoken")
UNSUPPORTED_MODES = ("weightedmean_tokens",)


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    modes: tuple[str, ...] = ("mean_tokens",)
    normalize: bool = False
    max_seq_length: int | None = None
    do_lower_case: bool = False

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in POOLING_MODES]
        if unknown or not self.modes:
            raise TesselError(f"pooling modes {list(self.modes)} not supported; tessel pools {POOLING_MODES}")


def read_pooling(directory: Path) -> PoolingConfig:
    """The pooling of a model directory (see the module docstring)."""
    modules_file = directory / "modules.json"
    settings = _sentence_bert_config(directory)
    if not modules_file.is_file():
        return PoolingConfig(**settings)
    modes: tuple[str, ...] = ("mean_tokens",)
    normalize = False
    for module in _modules(modules_file):
        kind = str(module.get("type", "")).removeprefix(ST_PREFIX)
        if kind not in KNOWN_MODULES:
            raise TesselError(
                f"{modules_file}: module {kind!r} is not supported; tessel runs {', '.join(KNOWN_MODULES)}"
            )
        if kind == "Pooling":
            modes = _pooling_modes(directory / str(module.get("path", "")) / "config.json")
        normalize = normalize or kind == "Normalize"
    return PoolingConfig(modes, normalize, **settings)


def _modules(path: Path) -> list[dict]:
    from tessel.files import parse_json_text, read_text_file

    modules = parse_json_text(read_text_file(path, "modules.json"), str(path))
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise TesselError(f"{path}: expected a JSON list of module objects")
    return modules


def _pooling_modes(path: Path) -> tuple[str, ...]:
    config = read_json_object(path)
    unsupported = [m for m in UNSUPPORTED_MODES if config.get(f"pooling_mode_{m}")]
    if unsupported:
        raise TesselError(f"{path}: pooling_mode_{unsupported[0]} is not supported")
    modes = tuple(m for m in POOLING_MODES if config.get(f"pooling_mode_{m}") is True)
    if not modes:
        names = ", ".join(f"pooling_mode_{m}" for m in POOLING_MODES)
        raise TesselError(f"{path}: no pooling mode is set; set one of {names}")
    return modes


def _sentence_bert_config(directory: Path) -> dict:
    path = directory / "sentence_bert_config.json"
    if not path.is_file():
        return {}
    config = read_json_object(path)
    length = config.get("max_seq_length")
    if length is not None and (type(length) is not int or length < 2):
        raise TesselError(f"{path}: max_seq_length must be a whole number >= 2, got {length!r}")
    lower = config.get("do_lower_case", False)
    if not isinstance(lower, bool):
        raise TesselError(f"{path}: do_lower_case must be true or false, got {lower!r}")
    return {"max_seq_length": length, "do_lower_case": lower}


def pool(hidden: torch.Tensor, mask: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """[batch, tokens, hidden] + 0/1 mask [batch, tokens] -> [batch, hidden * len(modes)] (float32)."""
    hidden = hidden.float()
    weights = mask.to(hidden.dtype).unsqueeze(-1)
    counts = weights.sum(1).clamp(min=1e-9)  # sentence-transformers' clamp
    vectors = []
    for mode in config.modes:
        if mode == "cls_token":
            vectors.append(hidden[:, 0])
        elif mode == "max_tokens":
            vectors.append(hidden.masked_fill(weights == 0, -1e9).amax(1))
        elif mode == "lasttoken":
            last = mask.to(torch.long).sum(1) - 1
            vectors.append(hidden[torch.arange(hidden.shape[0]), last])
        else:
            summed = (hidden * weights).sum(1)
            vectors.append(summed / (counts if mode == "mean_tokens" else counts.sqrt()))
    pooled = torch.cat(vectors, dim=-1)
    return torch.nn.functional.normalize(pooled, p=2, dim=1) if config.normalize else pooled
