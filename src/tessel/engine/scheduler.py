"""Continuous batching: which sequences run this step, and how many tokens of each.

Every step has a token budget (`max_num_batched_tokens`). Running sequences go first, in
arrival order: a decoding one costs one token, a partly prefilled one the rest of its prompt (or
what is left of the budget, with chunked prefill). Waiting sequences are then admitted while the
budget, `max_num_seqs` and the KV pool allow; a prompt longer than the remaining budget is cut
into chunks. When a running sequence needs a block and none is free, the most recently admitted
running sequence is preempted: its blocks are freed and it goes back to the front of the queue,
to be recomputed later (prefix caching usually makes that cheap).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tessel.engine.block_manager import BlockManager
from tessel.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True


@dataclass(slots=True)
class SchedulerOutput:
    """Sequences to run: `decodes` compute one token each, `prefills` (seq, n) compute n >= 2."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    def scheduled(self) -> list[tuple[Sequence, int]]:
        return [(seq, 1) for seq in self.decodes] + self.prefills


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _add_to_output(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        if n == 1:
            out.decodes.append(seq)
        else:
            out.prefills.append((seq, n))
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.time()

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: list[Sequence] = []
        while self.running and budget > 0:
            seq = self.running.popleft()
            n = min(len(seq) - seq.num_computed_tokens, budget)
            while not self.block_manager.reserve(seq, seq.num_computed_tokens + n):
                victim = self.running.pop() if self.running else seq
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            scheduled.append(seq)
            self._add_to_output(out, seq, n)
            budget -= n
        self.running.extendleft(reversed(scheduled))
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # cached blocks are not computed, and prompt logprobs need every prompt position's logits
            hits = bm.num_prefix_hits(seq) if seq.params.prompt_logprobs is None else 0
            n = len(seq) - hits * bm.block_size
            if n > budget and not self.config.enable_chunked_prefill:
                break
            if not bm.can_allocate(seq, hits):
                break
            self.waiting.popleft()
            bm.allocate(seq, hits)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(n, budget)
            self._add_to_output(out, seq, n)
            budget -= n

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and queue it first, to be recomputed from scratch."""
        self.block_manager.free(seq)
        self.num_preemptions += 1
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished (reason "stop" | "length" | "abort") and free its blocks now."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finish_time = time.time()
