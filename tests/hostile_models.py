"""Broken model directories: a copy of a tiny checkpoint (tests/tiny_models.py) with one thing wrong.

`FINDINGS[name] = (edit, file, field)`: `edit(dir)` breaks the copy; the model reader must refuse it
with one line naming `file` (config.json or model.safetensors) and `field`. `broken_copy` makes the
copy. The W8A8 scale edits (`SCALE_EDITS`) apply to a quantised checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file


def edit_config(**changes: object) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        (path / "config.json").write_text(json.dumps(config))  # NaN is written as JSON's NaN literal

    return edit


def _config_as_list(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps([config]))


def _truncate(path: Path) -> None:
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _random_bytes(path: Path) -> None:
    (path / "model.safetensors").write_bytes(random.Random(0).randbytes(5000))


def _huge_header(path: Path) -> None:
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")


FINDINGS: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "truncated": (_truncate, "model.safetensors", "truncated"),
    "random-bytes": (_random_bytes, "model.safetensors", "header"),
    "huge-header": (_huge_header, "model.safetensors", "header"),
    "hidden-size-string": (edit_config(hidden_size="64"), "config.json", "hidden_size"),
    "zero-heads": (edit_config(num_attention_heads=0), "config.json", "num_attention_heads"),
    "vocab-1e12": (edit_config(vocab_size=1e12), "config.json", "vocab_size"),
    "head-dim-7": (edit_config(head_dim=7), "config.json", "head_dim"),
    "kv-heads-3": (edit_config(num_key_value_heads=3), "config.json", "num_key_value_heads"),
    "config-list": (_config_as_list, "config.json", "JSON list"),
    "relu": (edit_config(hidden_act="relu"), "config.json", "hidden_act"),
    "null-hidden-act": (edit_config(hidden_act=None), "config.json", "hidden_act"),  # transformers refuses it
    "list-model-type": (edit_config(model_type=[]), "config.json", "model_type"),
    "nan-eps": (edit_config(rms_norm_eps=float("nan")), "config.json", "rms_norm_eps"),
    "layers-1e9": (edit_config(num_hidden_layers=1_000_000_000), "config.json", "num_hidden_layers"),
    "more-vocab-than-weights": (edit_config(vocab_size=2**31 - 1), "model.safetensors", "vocab_size"),
    "huge-positions": (
        edit_config(max_position_embeddings=2**31 - 1),
        "config.json",
        "max_position_embeddings",
    ),
}


def broken_copy(source: Path, target: Path, edit: Callable[[Path], None]) -> Path:
    shutil.copytree(source, target)
    edit(target)
    return target


def edit_tensor(name: str, change: Callable) -> Callable[[Path], None]:  # noqa: ANN001
    """An edit replacing tensor `name` of model.safetensors by `change(tensor)`."""

    def edit(path: Path) -> None:
        tensors = load_file(str(path / "model.safetensors"))
        tensors[name] = change(tensors[name]).contiguous()
        save_file(tensors, str(path / "model.safetensors"), {"format": "pt"})

    return edit


SCALE = "model.layers.0.self_attn.q_proj.weight_scale"
SCALE_EDITS = {  # W8A8 weight_scale edit -> what the message must say
    "zeros": (edit_tensor(SCALE, lambda s: s * 0), "zero or negative"),
    "negated": (edit_tensor(SCALE, lambda s: -s), "zero or negative"),
    "nan": (
        edit_tensor(SCALE, lambda s: s.index_fill(0, s.new_tensor([3], dtype=int), float("nan"))),
        "non-finite",
    ),
    "int32": (edit_tensor(SCALE, lambda s: (s * 1e4).int()), "I32"),
}
