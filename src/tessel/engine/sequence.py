"""One request while the engine works on it: its tokens, KV blocks and progress."""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch

from tessel.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Wall-clock times (time.time()) and prefix-cache hits of one request. Frozen: a change makes a
    new one (`but`), so every output shares its request's metrics of the moment, copied never."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0

    def but(self, **changes: float | int | None) -> RequestMetrics:
        """A copy with `changes` (a few per request, not per step)."""
        return dataclasses.replace(self, **changes)


class Sequence:
    """`token_ids` = prompt + output so far; the first `num_computed_tokens` have k/v in the cache.

    After a preemption by recompute `num_computed_tokens` is 0 again and everything is recomputed as
    a prompt; after one by swap the computed blocks wait in the host pool (`host_blocks`) and
    `num_computed_tokens` stays (`tessel.engine.preemption`).
    """

    _ids = itertools.count()

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        prompt: str | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.prompt_token_ids = list(prompt_token_ids)  # kept apart: outputs share it, never copy it
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.max_tokens = max_tokens if max_tokens is not None else (params.max_tokens or 1 << 62)
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []  # grows by appends; any other change makes a new list
        self.block_keys: list[tuple[int | None, tuple[int, ...]]] = []  # prefix-cache keys of full blocks
        self.num_registered_blocks = 0  # leading blocks whose key is in the prefix cache
        self.host_blocks: list[int] = []  # host pool blocks of its computed tokens while swapped out
        self.finish_reason: str | None = None
        self.error: BaseException | None = None  # why it finished with finish_reason "error"
        self.logprobs: list = []  # TokenLogprobs per output token (when params.logprobs is set)
        # TokenLogprobs per prompt position (position 0 has none), when params.prompt_logprobs is set
        self.prompt_logprobs: list = [None] * len(prompt_token_ids)
        self.metrics = RequestMetrics(arrival_time=time.time())
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.token_bitmask: Any = None  # a guided request's allowed tokens for its next sample (BitmaskRow)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_key(self, index: int) -> tuple[int | None, tuple[int, ...]]:
        """Prefix-cache key of full block `index`: (hash of the previous block's key, its token ids)."""
        while len(self.block_keys) <= index:
            i = len(self.block_keys)
            tokens = tuple(self.token_ids[i * self.block_size : (i + 1) * self.block_size])
            assert len(tokens) == self.block_size, "only full blocks have a key"
            parent = hash(self.block_keys[i - 1]) if i else None
            self.block_keys.append((parent, tokens))
        return self.block_keys[index]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
