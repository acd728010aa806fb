"""A run's requests checked against the model before any stage process starts.

Stage 0's engine checks a request when it is added, which is after every stage has loaded: a bad
one would end the run with exit 1 once the stages are up. `check_prompt_chars` and
`check_requests` make the same checks first, in the launching process, so `tessel launch` refuses
with exit 2 before spawning anything:

- a text prompt longer than `max_prompt_chars` (the server's `--max-prompt-chars`), by its
  characters before it is tokenized: a 10 MB line is refused at once, not tokenized whole;
- token ids outside the vocabulary, `top_k` above it (`SamplingParams.verify`, the engine's rule);
- a prompt plus `max_tokens` longer than `max_model_len` (the engine's `max_model_len`).

Each message names the request ("FILE:LINE" of a prompts-file line, "--prompt N").
"""

from __future__ import annotations

from pathlib import Path

from tessel.engine.engine_config import EngineConfig
from tessel.engine.llm_engine import _load_tokenizer, max_model_len
from tessel.errors import TesselError
from tessel.models.config import ModelConfig
from tessel.pipeline.prompts_file import RunRequest
from tessel.text import check_text


def check_prompt_chars(requests: list[RunRequest], max_prompt_chars: int) -> None:
    """Refuse a text prompt over `max_prompt_chars` characters (before anything tokenizes it)."""
    for request in requests:
        if isinstance(request.prompt, str) and len(request.prompt) > max_prompt_chars:
            raise TesselError(
                f"{request.where}: the prompt has {len(request.prompt)} characters; at most "
                f"{max_prompt_chars} are accepted (--max-prompt-chars)"
            )


def check_requests(
    requests: list[RunRequest], model: Path, model_config: ModelConfig, engine_options: dict
) -> None:
    """Refuse what stage 0's engine would refuse when adding the requests (see the module)."""
    context = max_model_len(EngineConfig(**engine_options), model_config)
    vocab = model_config.vocab_size
    for request in requests:
        try:
            request.params.verify(vocab)
        except TesselError as error:
            raise TesselError(f"{request.where}: {error}") from None
    lengths = _prompt_lengths(requests, model, vocab)
    for request, length in zip(requests, lengths, strict=True):
        max_tokens = request.params.max_tokens
        total = length + (max_tokens if max_tokens is not None else 1)
        if total > context:
            raise TesselError(
                f"{request.where}: the prompt has {length} tokens and max_tokens is {max_tokens}: {total} > "
                f"max_model_len={context}; shorten the prompt, lower max_tokens or raise --max-model-len"
            )


def _prompt_lengths(requests: list[RunRequest], model: Path, vocab: int) -> list[int]:
    """Tokens per prompt: text prompts tokenized in one batch, token-id prompts checked."""
    texts = {}
    for index, request in enumerate(requests):
        if isinstance(request.prompt, str):
            try:
                texts[index] = check_text(request.prompt, "the prompt")
            except TesselError as error:
                raise TesselError(f"{request.where}: {error}") from None
        else:
            bad = [t for t in request.prompt if not 0 <= t < vocab]
            if bad:
                shown = [t if abs(t) < 10**12 else "..." for t in bad[:5]]
                raise TesselError(
                    f"{request.where}: prompt token ids {shown} are outside the vocabulary [0, {vocab})"
                )
    encoded = {}
    if texts:
        ids = _load_tokenizer(model)(list(texts.values()))["input_ids"]
        encoded = dict(zip(texts, ids, strict=True))
    lengths = []
    for index, request in enumerate(requests):
        length = len(encoded[index]) if index in encoded else len(request.prompt)
        if length == 0:
            raise TesselError(f"{request.where}: the prompt is empty; give at least one token")
        lengths.append(length)
    return lengths
