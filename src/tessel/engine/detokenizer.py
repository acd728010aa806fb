"""Incremental detokenization with stop strings.

Each new token decodes a short window (`prefix_offset:`) instead of the whole output, the way
vLLM and TGI do; a window that ends in an incomplete UTF-8 character ("\ufffd") waits for the
next token. With a Rust (`tokenizers`) tokenizer the window is its `DecodeStream`, the same
algorithm in one call per token instead of two decodes from Python (the `detokenise` column of
benchmarks/host_step.py). With stop strings, the last `max(len(stop)) - 1` characters are held
back until the request ends, so streamed text never shows the start of a stop string that is
later cut.

Without stop strings the engine needs no text to run a request, so with a `DecodeStream` the
detokenizer is `deferred`: the engine feeds it nothing while it steps, and an output's `text` is
decoded when first read (`text_of`, through `RequestOutput`): the same `DecodeStream` steps, token
by token, only off the step (a server reads each output; `LLM.generate` only the last).
"""

from __future__ import annotations

from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the Python-side window only
    DecodeStream = None

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        may_defer: bool = False,
    ) -> None:
        """`may_defer`: the caller feeds the tokens when their text is read (`text_of`) where it can
        (no stop strings, a `DecodeStream`); `deferred` says whether it does."""
        backend = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer: no Python overhead
        self._decode_fn = backend.decode if backend is not None and hasattr(backend, "decode") else None
        self._backend = backend
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.full_text = ""  # everything decoded so far (before any stop-string cut)
        self.text = ""  # what the caller may see
        self.stopped_by: str | None = None
        self.ends = [0]  # len(full_text) after each output token added (the first: none yet)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.emitted_chars = 0  # characters of text the caller has reported (not deferred)
        self.emitted_tokens = 0  # output tokens the caller has reported (deferred)
        self._stream = None
        if DecodeStream is not None and self._decode_fn is not None:
            self._stream = DecodeStream(ids=self.tokens, skip_special_tokens=skip_special_tokens)
        self.deferred = may_defer and not stop and self._stream is not None

    def _decode(self, ids: list[int]) -> str:
        if self._decode_fn is not None:
            return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)
        return self._tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Decode one more token; -> the stop string it completed, if any."""
        self.tokens.append(token_id)
        new_text = self._new_text(token_id)
        if new_text:
            old_len = len(self.full_text)
            self.full_text += new_text
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            if self.stop:
                start = max(0, old_len - self.hold_back)
                found = [(i, s) for s in self.stop if (i := self.full_text.find(s, start)) >= 0]
                if found:
                    index, self.stopped_by = min(found)
                    self.text = self.full_text[:index]
                    self.ends.append(len(self.full_text))
                    return self.stopped_by
        self.ends.append(len(self.full_text))
        if self.deferred:  # `text` is set when it ends (`_release`); before, `text_of` slices
            return None
        visible = len(self.full_text) - self.hold_back
        if visible > len(self.text):
            self.text = self.full_text[:visible]
        return None

    def _new_text(self, token_id: int) -> str | None:
        """The text `token_id` completes (None: it ends in an incomplete character, or adds none)."""
        if self._stream is not None:
            return self._stream.step(self._backend, token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        window = self._decode(self.tokens[self.prefix_offset :])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            return window[len(prefix) :]
        return None

    def text_of(self, all_ids: list[int], count: int, finished: bool) -> str:
        """A deferred request's text after its first `count` output tokens (`all_ids`: prompt + output
        so far), as `add_token` would have shown it then; `finished`: it ended there (`finish`)."""
        start = self.num_prompt_tokens
        while len(self.ends) <= count:
            self.add_token(all_ids[start + len(self.ends) - 1])
        if finished:
            self._release()
            return self.text
        return self.full_text[: self.ends[count]]

    def finish(self) -> None:
        """The request ended: release held-back text (unless a stop string cut it). Deferred: nothing
        yet (its last output's `text_of` does it, once every token is in)."""
        if not self.deferred:
            self._release()

    def _release(self) -> None:
        if self.stopped_by is not None:
            return
        if self.read_offset < len(self.tokens):  # an incomplete character at the very end
            prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            self.full_text += self._decode(self.tokens[self.prefix_offset :])[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.tokens)
        self.text = self.full_text
