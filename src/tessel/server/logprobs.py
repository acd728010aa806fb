"""The engine's `TokenLogprobs` in OpenAI's two response shapes (legacy completions and chat).

Tokens are shown as the tokenizer decodes each one alone (a byte-level token holding half a UTF-8
character decodes to U+FFFD, as in vLLM). `TokenText` owns its own copy of the tokenizer, used only
on the event loop thread. A logprob of -inf (which JSON cannot carry) is written as -9999.0, vLLM's
choice.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from tessel.engine.outputs import TokenLogprobs
from tessel.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

MIN_LOGPROB = -9999.0
_TOKEN_TEXT_CACHE = 1 << 16


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class TokenText:
    """token id -> its text, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._cached = functools.lru_cache(maxsize=_TOKEN_TEXT_CACHE)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def __call__(self, token_id: int) -> str:
        return self._cached(token_id)


def completion_logprobs(
    entries: list[TokenLogprobs | None], text: TokenText, token_ids: list[int], start_offset: int = 0
) -> CompletionLogprobs:
    """Parallel lists over `token_ids`; `entries[i]` None (the first prompt token) gives nulls."""
    result = CompletionLogprobs()
    offset = start_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = text(token_id)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_finite(entry.logprob))
        top = {text(i): _finite(lp) for i, lp in entry.top}
        top.setdefault(token, _finite(entry.logprob))  # the chosen token is always listed, as in vLLM
        result.top_logprobs.append(top)
    return result


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8")))


def chat_logprobs(entries: list[TokenLogprobs], text: TokenText) -> ChatLogprobs:
    content = []
    for entry in entries:
        token = text(entry.token_id)
        top = [_top(text(i), lp) for i, lp in entry.top]
        content.append(ChatTokenLogprob(**_top(token, entry.logprob).model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)
