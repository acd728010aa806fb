"""What the engine reports about a request after a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessel.engine.sequence import RequestMetrics


@dataclass(slots=True)
class TokenLogprobs:
    """One position: the token there, its log-probability, and the `k` most likely (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


_FIELDS = (
    "request_id", "prompt_token_ids", "token_ids", "new_token_ids", "text", "new_text", "finished",
    "finish_reason", "num_prompt_tokens", "num_output_tokens", "metrics", "prompt", "error", "logprobs",
    "prompt_logprobs",
)  # fmt: skip


class RequestOutput:
    """`token_ids` / `text`: all output so far; `new_token_ids` / `new_text`: this step's delta.

    `finish_reason` is "stop" (EOS, a stop token or a stop string), "length" (max_tokens or
    max_model_len), "abort", or "error" (running this request failed; `error` says why; the
    other requests carried on); None while running. `prompt` is the text given to
    `add_request` (None when it was token ids). `logprobs` / `prompt_logprobs`: see `SamplingParams`.

    The engine makes one per running request per step, so what most readers never look at is built
    when first read (`later`): `token_ids` is sliced from the request's tokens, and the text of a
    request without stop strings is decoded by its `IncrementalDetokenizer` only then (up to this
    output's tokens, whatever the request did since). Read it on the thread that steps the engine
    (the detokenizer is not thread-safe), or call `resolve()` there first.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "_token_ids", "new_token_ids", "_text", "_new_text", "finished",
        "finish_reason", "num_prompt_tokens", "num_output_tokens", "metrics", "prompt", "error", "logprobs",
        "prompt_logprobs", "_all_ids", "_detokenizer", "_previous",
    )  # fmt: skip

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        token_ids: list[int] | None,
        new_token_ids: list[int],
        text: str | None,
        new_text: str | None,
        finished: bool,
        finish_reason: str | None,
        num_prompt_tokens: int,
        num_output_tokens: int,
        metrics: RequestMetrics,
        prompt: str | None = None,
        error: BaseException | None = None,
        logprobs: list[TokenLogprobs] | None = None,  # per output token, when SamplingParams.logprobs is set
        prompt_logprobs: list[TokenLogprobs | None] | None = None,  # per prompt token (first None)
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._token_ids = token_ids
        self.new_token_ids = new_token_ids
        self._text = text
        self._new_text = new_text
        self.finished = finished
        self.finish_reason = finish_reason
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = num_output_tokens
        self.metrics = metrics
        self.prompt = prompt
        self.error = error
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self._all_ids: list[int] | None = None
        self._detokenizer: Any = None
        self._previous = 0

    @classmethod
    def unfinished(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        new_token_ids: list[int],
        num_prompt_tokens: int,
        num_output_tokens: int,
        metrics: RequestMetrics,
        prompt: str | None,
        all_ids: list[int],
        detokenizer: Any,
        previous: int,
    ) -> RequestOutput:
        """`RequestOutput(...).later(all_ids, detokenizer, previous)` for a running request without
        logprobs (no reason, no error), its slots set without `__init__`'s call, which costs as much
        as they do: the engine makes one per running request per step."""
        self = object.__new__(cls)
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._token_ids = self._text = self._new_text = None
        self.new_token_ids = new_token_ids
        self.finished = False
        self.finish_reason = self.error = self.logprobs = self.prompt_logprobs = None
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = num_output_tokens
        self.metrics = metrics
        self.prompt = prompt
        self._all_ids, self._detokenizer, self._previous = all_ids, detokenizer, previous
        return self

    def later(self, all_ids: list[int], detokenizer: Any, previous: int) -> RequestOutput:
        """This output with `token_ids` (given as None) read from `all_ids` (prompt + output, which
        only grows) and, when `detokenizer` is given (its text given as None), `text` and `new_text`
        decoded by it: the text of the first `num_output_tokens` output tokens, less that of the
        first `previous` (the request's output before this one); -> self."""
        self._all_ids, self._detokenizer, self._previous = all_ids, detokenizer, previous
        return self

    @property
    def token_ids(self) -> list[int]:
        if self._token_ids is None:
            start = self.num_prompt_tokens
            self._token_ids = self._all_ids[start : start + self.num_output_tokens]
        return self._token_ids

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._detokenizer.text_of(self._all_ids, self.num_output_tokens, self.finished)
        return self._text

    @property
    def new_text(self) -> str:
        if self._new_text is None:
            text = self.text
            before = self._detokenizer.text_of(self._all_ids, self._previous, False)
            self._new_text = text[len(before) :] if len(text) > len(before) else ""
        return self._new_text

    def resolve(self) -> RequestOutput:
        """Everything built now (before handing it to another thread); -> self."""
        _ = self.token_ids, self.new_text
        self._all_ids = self._detokenizer = None
        return self

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in _FIELDS)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    __hash__ = None  # mutable, as the dataclass it was

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={value!r}" for name, value in zip(_FIELDS, self._values(), strict=True))
        return f"RequestOutput({shown})"

    def __reduce__(self) -> tuple:
        return (RequestOutput, self._values())
