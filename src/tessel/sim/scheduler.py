"""Continuous batching: which prefill chunks and decode steps go into the next micro-batch.

The policy follows vLLM's and SGLang's chunked-prefill schedulers: every micro-batch has a token
budget (`max_num_batched_tokens`); decode steps of running sequences go first (one token each), then the
next prefill chunk of sequences already admitted, then new requests in arrival order while fewer
than `max_num_seqs` sequences run (and, if set, while their KV fits `kv_capacity_tokens`: a request
reserves prompt + output tokens when admitted and frees them when it finishes; no preemption).

A decode step of a sequence needs its previous token, so a sequence in flight gets no decode step.
Prefill chunks of one sequence may follow each other into the pipeline before the previous one has
left it (`pipelined_prefill`, CPP): chunk i only needs chunks < i, which every stage has already
processed because stages run micro-batches in the order they entered the pipeline.
With `groups` > 1, each request is pinned on arrival to the group (virtual engine) with the fewest
unfinished requests, and `schedule(group)` only looks at that group's sequences, as vLLM V0's
pipeline parallelism runs one scheduler per virtual engine; with one group (the default) every
micro-batch draws from one pool, as vLLM V1 does.
`chunk_sizes`, when given, cuts each prompt (e.g. the CPP plan from `tessel.chunk`); otherwise a
prompt is cut by the budget left in the micro-batch (or not at all when `enable_chunked_prefill` is off).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tessel.errors import TesselError
from tessel.sim.requests import Request

ChunkSizer = Callable[[Request], list[int]]
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's default max_num_batched_tokens with chunked prefill


@dataclass(slots=True)
class SimSchedulerConfig:
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # sequences admitted at once
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # tokens per micro-batch
    enable_chunked_prefill: bool = True
    pipelined_prefill: bool = False  # CPP: several chunks of one prompt in flight at once
    chunk_sizes: ChunkSizer | None = None  # fixed cut of each prompt into chunks (CPP plan)
    kv_capacity_tokens: int | None = None  # KV tokens the pipeline can hold (None = unlimited)
    groups: int = 1  # > 1: each request pinned to one of this many virtual engines (vLLM V0 PP)

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"groups must be >= 1, got {self.groups}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be >= 1, "
                f"got {self.max_num_seqs} and {self.max_num_batched_tokens}"
            )
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be >= 1, got {self.kv_capacity_tokens}")


@dataclass(frozen=True, slots=True)
class Work:
    """One sequence's share of a micro-batch: a prefill chunk, or one decode step (tokens = 1).

    `offset` is the number of that sequence's tokens already in the KV cache; a decode step
    attends to offset + 1 tokens. `samples` is true when the work ends with a token to sample
    (every decode step, and the last chunk of a prompt): the last stage computes its logits.
    """

    request_id: int
    kind: str  # "prefill" | "decode"
    tokens: int
    offset: int
    samples: bool = True


@dataclass(frozen=True, slots=True)
class MicroBatch:
    id: int
    items: tuple[Work, ...]
    group: int = 0  # the virtual engine it belongs to (0 when all share one pool)

    @property
    def tokens(self) -> int:
        return sum(item.tokens for item in self.items)

    @property
    def request_ids(self) -> tuple[int, ...]:
        return tuple(item.request_id for item in self.items)


@dataclass(slots=True)
class SimSequence:
    request: Request
    chunks: deque[int] = field(default_factory=deque)  # planned prefill chunks not yet scheduled
    scheduled_prompt: int = 0  # prompt tokens put into micro-batches
    done_prompt: int = 0  # prompt tokens whose chunk has left the last stage
    generated: int = 0  # tokens that have left the last stage (the first comes with the prefill)
    in_flight: int = 0  # micro-batches in the pipeline holding this sequence
    first_token_s: float | None = None
    finish_s: float | None = None
    group: int = 0  # the virtual engine this sequence is pinned to

    @property
    def prefill_left(self) -> int:
        return self.request.prompt_tokens - self.scheduled_prompt

    @property
    def can_decode(self) -> bool:
        request = self.request
        return (
            self.done_prompt == request.prompt_tokens
            and self.in_flight == 0
            and (self.generated < request.output_tokens)
        )

    @property
    def kv_tokens(self) -> int:
        return self.request.prompt_tokens + self.request.output_tokens


class SimScheduler:
    """Holds waiting and running sequences; `schedule()` returns the next micro-batch or None."""

    def __init__(self, config: SimSchedulerConfig) -> None:
        self.config = config
        self.waiting: list[deque[SimSequence]] = [deque() for _ in range(config.groups)]
        self.running: list[SimSequence] = []
        self.unfinished = [0] * config.groups
        self.finished: list[SimSequence] = []
        self.kv_used_tokens = 0
        self._next_batch_id = 0

    def add(self, request: Request) -> SimSequence:
        capacity = self.config.kv_capacity_tokens
        sequence = SimSequence(request)
        if capacity is not None and sequence.kv_tokens > capacity:
            raise TesselError(
                f"request {request.id} needs {sequence.kv_tokens} KV tokens (prompt + output), "
                f"more than the pipeline holds ({capacity}); shorten it or give the plan more memory"
            )
        if self.config.chunk_sizes is not None:
            chunks = [int(size) for size in self.config.chunk_sizes(request)]
            if sum(chunks) != request.prompt_tokens or min(chunks) < 1:
                raise ValueError(
                    f"chunk plan {chunks} does not cut request {request.id}'s "
                    f"{request.prompt_tokens} prompt tokens into positive chunks"
                )
            sequence.chunks = deque(chunks)
        sequence.group = min(range(self.config.groups), key=lambda g: (self.unfinished[g], g))
        self.unfinished[sequence.group] += 1
        self.waiting[sequence.group].append(sequence)
        return sequence

    @property
    def batches_formed(self) -> int:
        return self._next_batch_id

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running or any(self.waiting))

    def schedule(self, group: int = 0) -> MicroBatch | None:
        """The next micro-batch of the sequences pinned to `group` (all of them when groups = 1)."""
        config = self.config
        budget = config.max_num_batched_tokens
        items: list[Work] = []
        waiting = self.waiting[group]
        running = [sequence for sequence in self.running if sequence.group == group]
        for sequence in running:
            if budget == 0:
                break
            if sequence.can_decode:
                offset = sequence.request.prompt_tokens + sequence.generated - 1
                items.append(Work(sequence.request.id, "decode", 1, offset))
                budget -= 1
        for sequence in running:
            if budget == 0:
                break
            budget -= self._add_prefill(sequence, budget, items)
        while waiting and budget > 0 and len(self.running) < config.max_num_seqs:
            sequence = waiting[0]
            if config.kv_capacity_tokens is not None and (
                self.kv_used_tokens + sequence.kv_tokens > config.kv_capacity_tokens
            ):
                break
            taken = self._add_prefill(sequence, budget, items)
            if taken == 0:
                break
            waiting.popleft()
            self.running.append(sequence)
            self.kv_used_tokens += sequence.kv_tokens
            budget -= taken
        if not items:
            return None
        batch = MicroBatch(self._next_batch_id, tuple(items), group)
        self._next_batch_id += 1
        by_id = {sequence.request.id: sequence for sequence in self.running}
        for item in items:
            by_id[item.request_id].in_flight += 1
        return batch

    def _add_prefill(self, sequence: SimSequence, budget: int, items: list[Work]) -> int:
        """Put the sequence's next prefill chunk into `items` if it may go; return its tokens."""
        left = sequence.prefill_left
        if left == 0 or (sequence.in_flight > 0 and not self.config.pipelined_prefill):
            return 0
        empty = not items
        if sequence.chunks:
            size = sequence.chunks[0]
        elif self.config.enable_chunked_prefill:
            size = min(left, budget)
        else:
            size = left
        if size > budget and not empty:  # an oversized chunk goes alone, never split further
            return 0
        if sequence.chunks:
            sequence.chunks.popleft()
        last = size == left
        items.append(Work(sequence.request.id, "prefill", size, sequence.scheduled_prompt, last))
        sequence.scheduled_prompt += size
        return min(size, budget)

    def complete(self, batch: MicroBatch, now_s: float) -> None:
        """The batch left the last stage at `now_s`: its tokens exist."""
        by_id = {sequence.request.id: sequence for sequence in self.running}
        for item in batch.items:
            sequence = by_id[item.request_id]
            sequence.in_flight -= 1
            if item.kind == "prefill":
                sequence.done_prompt += item.tokens
                if sequence.done_prompt == sequence.request.prompt_tokens:
                    sequence.generated = 1
                    sequence.first_token_s = now_s
            else:
                sequence.generated += 1
            if sequence.generated == sequence.request.output_tokens and sequence.in_flight == 0:
                sequence.finish_s = now_s
        done = [sequence for sequence in self.running if sequence.finish_s is not None]
        if done:
            self.running = [sequence for sequence in self.running if sequence.finish_s is None]
            self.finished.extend(done)
            for sequence in done:
                self.unfinished[sequence.group] -= 1
            self.kv_used_tokens -= sum(sequence.kv_tokens for sequence in done)
