"""Several micro-batches in flight: one engine `Scheduler` per in-flight slot over one KV pool.

Pipeline parallelism needs a sequence in at most one micro-batch at a time (step k+1 needs step
k's token). As vLLM V0 does, each request is pinned on arrival to the slot ("virtual engine")
with the fewest unfinished requests; each slot's scheduler is the engine's own (token budget,
chunked prefill, prefix cache, preemption), all sharing one `BlockManager`, and a slot is
scheduled again only when its previous micro-batch has come back. `add`, `finish` and
`num_unfinished` are what `LLMEngine` calls on its scheduler; `running` and `waiting` (every slot's,
slot by slot) are what the server's metrics read of it, from another thread.
"""

from __future__ import annotations

from tessel.engine.block_manager import BlockManager
from tessel.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tessel.engine.sequence import Sequence


class PinnedSchedulers:
    def __init__(self, num_slots: int, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if num_slots < 1:
            raise ValueError(f"need at least one in-flight slot, got {num_slots}")
        self.slots = [Scheduler(config, block_manager) for _ in range(num_slots)]
        self._slot_of: dict[int, int] = {}  # seq_id -> slot

    @property
    def num_unfinished(self) -> int:
        return sum(s.num_unfinished for s in self.slots)

    @property
    def running(self) -> list[Sequence]:
        """Sequences admitted to a slot's batch (in flight or between micro-batches)."""
        return [seq for slot in self.slots for seq in list(slot.running)]  # list(): one C-level copy

    @property
    def waiting(self) -> list[Sequence]:
        """Sequences queued in a slot, not yet admitted (or preempted)."""
        return [seq for slot in self.slots for seq in list(slot.waiting)]

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.slots)

    def add(self, seq: Sequence) -> None:
        slot = min(range(len(self.slots)), key=lambda i: (self.slots[i].num_unfinished, i))
        self._slot_of[seq.seq_id] = slot
        self.slots[slot].add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.slots[self._slot_of.pop(seq.seq_id)].finish(seq, reason)

    def schedule(self, slot: int) -> SchedulerOutput:
        return self.slots[slot].schedule()
