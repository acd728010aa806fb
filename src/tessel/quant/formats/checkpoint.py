"""Writing a compressed-tensors checkpoint directory (its layout and reading:
`tessel.models.quantized.compressed_tensors`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tessel.files import OUTPUT_MARKER, staged_directory

WEIGHTS_FILE = "model.safetensors"
SKIPPED_FILES = ("config.json", "model.safetensors.index.json")


def write_checkpoint(
    out_dir: Path,
    source_dir: Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    *,
    overwrite: bool = False,
    inputs: tuple[str | Path | None, ...] = (),
) -> Path:
    """Write config.json + model.safetensors (+ the source's tokenizer files) to `out_dir` atomically.

    Everything goes to a fresh directory beside `out_dir`, which is moved into place at the end: a
    failed run leaves nothing half-written (`tessel.files.staged_directory`). `out_dir` may not be
    `source_dir`, a folder holding it, or anything in `inputs`; an existing `out_dir` is replaced only
    with `overwrite`, and only when tessel wrote it.
    """
    out_dir = Path(out_dir)
    with staged_directory(out_dir, "--out", inputs=(source_dir, *inputs), overwrite=overwrite) as staging:
        for item in Path(source_dir).iterdir():
            if (
                item.is_file()
                and item.name not in (*SKIPPED_FILES, OUTPUT_MARKER)
                and item.suffix != ".safetensors"
            ):
                shutil.copy2(item, staging / item.name)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(staging / WEIGHTS_FILE), {"format": "pt"}
        )
    return out_dir
