"""Continuous batching: which sequences run this step, and how many tokens of each.

Every step has a token budget (`max_num_batched_tokens`). Running sequences go first, in
arrival order: a decoding one costs one token, a partly prefilled one the rest of its prompt (or
what is left of the budget, with chunked prefill). Waiting sequences are then admitted while the
budget, `max_num_seqs` and the KV pool allow; a prompt longer than the remaining budget is cut
into chunks. When a running sequence needs a block and none is free, the most recently admitted
running sequence is preempted: its blocks are freed and it goes back to the front of the queue,
either to be recomputed later (prefix caching sometimes makes that cheap) or, when the engine's
`Preemptor` swaps it, with its computed blocks in the host pool, copied back when it is admitted
again (`tessel.engine.preemption` chooses, per sequence).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tessel.engine.block_manager import BlockManager
from tessel.engine.preemption import Preemptor
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
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, preemptor: Preemptor | None = None
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.preemptor = preemptor  # None: preemption by recompute
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
            seq.metrics = seq.metrics.but(first_scheduled_time=time.time())

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: list[Sequence] = []
        running, decodes, reserve = self.running, out.decodes, self.block_manager.reserve
        while running and budget > 0:
            seq = running.popleft()
            end = len(seq.token_ids)
            n = end - seq.num_computed_tokens
            if n > budget:
                n, end = budget, seq.num_computed_tokens + budget
            # `reserve` only where the table falls short (it has nothing to do otherwise)
            if end > len(seq.block_table) * seq.block_size:
                while not reserve(seq, end):
                    victim = running.pop() if running else seq
                    self.preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    break
            scheduled.append(seq)
            if n == 1 and seq.metrics.first_scheduled_time is not None:  # `_add_to_output`, inlined
                decodes.append(seq)
            else:
                self._add_to_output(out, seq, n)
            budget -= n
        running.extendleft(reversed(scheduled))
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.host_blocks:
                n = self._swap_in(seq, out, budget)
                if n == 0:
                    break
                budget -= n
                continue
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

    def _swap_in(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int:
        """Admit a swapped-out `seq`: its blocks copied back, its remaining tokens scheduled;
        -> how many (0: not admitted, the pool or the budget is short)."""
        assert self.preemptor is not None
        n = len(seq) - seq.num_computed_tokens
        if n > budget and not self.config.enable_chunked_prefill:
            return 0
        if not self.preemptor.can_swap_in(seq):
            return 0
        self.waiting.popleft()
        self.preemptor.swap_in(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        n = min(n, budget)
        self._add_to_output(out, seq, n)
        return n

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks (swapped to the host pool or dropped, as the preemptor chooses) and
        queue it first."""
        self.num_preemptions += 1
        if self.preemptor is not None:
            self.preemptor.preempt(seq)
        else:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished (reason "stop" | "length" | "abort") and free its blocks now."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            if self.preemptor is not None:
                self.preemptor.release(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics = seq.metrics.but(finish_time=time.time())
