"""Grammars compiled once, matched token by token: the engine's side of guided decoding.

`GuidedDecoder.compile` validates and compiles a `GuidedDecoding` into an llguidance matcher kept in
an LRU cache keyed by the grammar text (the server calls it on a tokenizer thread, so a new schema
is compiled off the engine thread; the engine's call finds it cached). Each request gets a copy of
the cached matcher (`start`). Before a micro-batch runs, `masks` hands out the allowed-token bitmask
rows of its guided sequences, which the sampler reads (`BitmaskRow.array`). With `overlap` (the
forward runs on a GPU) the rows are filled on a worker thread while the forward runs (llguidance
fills rows in parallel without the GIL); without it (the forward runs on the host's cores) they are
filled when first read, one row after another on the reading thread: a thread beside a CPU forward
takes cores from its OpenMP workers, which then wait on each other (on a 2-core machine the forward
slowed several-fold beside llguidance's pool). After sampling, `accept` advances each matcher by
its token.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tessel.engine.guided.spec import GuidedDecoding, InvalidGuidedDecoding

CACHED_GRAMMARS = 256  # compiled matchers kept (LRU); a compile of a large schema takes milliseconds
# finish_reason of a guided request whose grammar allowed no token at all (it ends rather than hang)
GRAMMAR_DEAD_END = "grammar_dead_end"


@dataclass(frozen=True, slots=True)
class BitmaskRow:
    """One row of a batch's allowed-token bitmask (int32 words, bit i of word w: token 32w+i),
    ready, or filled on demand (`source` a future or a `DeferredFill` of the whole bitmask)."""

    source: Future | DeferredFill | np.ndarray
    row: int

    def array(self) -> np.ndarray:
        bitmask = self.source if isinstance(self.source, np.ndarray) else self.source.result()
        return bitmask[self.row]


class DeferredFill:
    """A bitmask filled by its first `result()`, on the calling thread, once."""

    def __init__(self, fill: Any) -> None:
        self._fill, self._bitmask = fill, None
        self._lock = threading.Lock()

    def result(self) -> np.ndarray:
        with self._lock:
            if self._bitmask is None:
                self._bitmask = self._fill()
            return self._bitmask


class GuidedDecoder:
    """Matchers of the engine's guided requests, by sequence id."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int], overlap: bool = False
    ) -> None:
        self._overlap = overlap
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: Any = None  # llguidance's view of the vocabulary, built on first use
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # compile runs on tokenizer threads and the engine thread
        self._matchers: dict[int, Any] = {}
        self._workers = ThreadPoolExecutor(1, thread_name_prefix="tessel-bitmask")
        self._executor: Any = None

    def compile(self, guided: GuidedDecoding) -> Any:
        """The compiled matcher for `guided` (cached); `InvalidGuidedDecoding` says why it cannot be."""
        import llguidance

        grammar = self._grammar_text(guided)
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
            tokenizer = self._llg_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidGuidedDecoding(f"the {guided.kind} cannot guide decoding: {error}")
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise InvalidGuidedDecoding(f"the {guided.kind} cannot guide decoding: {matcher.get_error()}")
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher

    def _grammar_text(self, guided: GuidedDecoding) -> str:
        try:
            return guided.grammar()
        except Exception as error:  # llguidance parses the spec to build the grammar document
            raise InvalidGuidedDecoding(f"the {guided.kind} cannot guide decoding: {error}") from error

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_token_ids
            )
        return self._tokenizer

    def start(self, seq_id: int, guided: GuidedDecoding) -> None:
        self._matchers[seq_id] = self.compile(guided).deep_copy()

    def release(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def clear(self) -> None:
        self._matchers.clear()

    def guides(self, seq_id: int) -> bool:
        return seq_id in self._matchers

    @property
    def active(self) -> bool:
        """Some request is guided (when none is, a step skips every per-request guided call)."""
        return bool(self._matchers)

    def masks(self, seq_ids: list[int]) -> list[BitmaskRow]:
        """Start filling the bitmask rows of `seq_ids` (all guided), one per id, in order."""
        import llguidance
        import llguidance.numpy

        matchers = [self._matchers[seq_id] for seq_id in seq_ids]
        bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), self._vocab_size)
        if not self._overlap:

            def fill_here() -> np.ndarray:
                for row, matcher in enumerate(matchers):
                    llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row)
                return bitmask

            deferred = DeferredFill(fill_here)
            return [BitmaskRow(deferred, row) for row in range(len(matchers))]
        if self._executor is None:
            self._executor = llguidance.LLExecutor()

        def fill_beside() -> np.ndarray:
            llguidance.numpy.fill_next_token_bitmask_par(
                self._executor, [(matcher, row) for row, matcher in enumerate(matchers)], bitmask
            )
            return bitmask

        future = self._workers.submit(fill_beside)
        return [BitmaskRow(future, row) for row in range(len(matchers))]

    def accept(self, seq_id: int, token: int) -> bool:
        """Advance the sequence's matcher by `token`; False if the grammar cannot take it (a dead end:
        no token was allowed)."""
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            return True
        return matcher.consume_token(token) and not matcher.is_error()

    def finished(self, seq_id: int) -> bool:
        """The grammar is complete and allows nothing more (not even end of text)."""
        matcher = self._matchers.get(seq_id)
        return matcher is not None and matcher.is_stopped()

    def shutdown(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
