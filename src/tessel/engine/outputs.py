"""What the engine reports about a request after a step."""

from __future__ import annotations

from dataclasses import dataclass

from tessel.engine.sequence import RequestMetrics


@dataclass(slots=True)
class TokenLogprobs:
    """One position: the token there, its log-probability, and the `k` most likely (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class RequestOutput:
    """`token_ids` / `text`: all output so far; `new_token_ids` / `new_text`: this step's delta.

    `finish_reason` is "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
    max_model_len), "abort", or "error" (running this request failed; `error` says why; the
    other requests carried on); None while running. `prompt` is the text given to
    `add_request` (None when it was token ids). `logprobs` / `prompt_logprobs`: see `SamplingParams`.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    metrics: RequestMetrics
    prompt: str | None = None
    error: BaseException | None = None
    logprobs: list[TokenLogprobs] | None = None  # per output token, when SamplingParams.logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token (first None), when asked
