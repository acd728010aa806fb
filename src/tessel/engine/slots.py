"""Micro-batches in flight: one engine `Scheduler` per in-flight slot, slots grouped by path.

An executor that pipelines (`tessel.pipeline.executor`) keeps several micro-batches in flight, and
a sequence may be in at most one of them (step k+1 needs step k's token). As vLLM V0 does, each
request is pinned on arrival to a slot ("virtual engine"); each slot's scheduler is the engine's own
(token budget, chunked prefill, prefix cache, preemption), all sharing one block manager, and a slot
is scheduled again only when its previous micro-batch has come back. One process running the whole
model is one path of one slot.

With several paths (a flow plan's routes through shared GPUs) a request is first dealt a path by
the paths' weights (`tessel.plan.replicas.weighted_turns`: after n requests each path holds within one of
its share), then the path's slot with the fewest unfinished requests; its KV blocks come from its
path's id range (`tessel.engine.block_manager.PathBlockManagers`). `add`, `finish` and
`num_unfinished` are what the engine calls; `running` and `waiting` (every slot's, slot by slot) are
what the server's metrics read, from another thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.engine.block_manager import BlockManager, PathBlockManagers
from tessel.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tessel.engine.sequence import Sequence
from tessel.plan.replicas.weighted_turns import WeightedTurns


@dataclass(frozen=True, slots=True)
class SlotPath:
    """One path as the engine schedules it: its share of the requests and its in-flight slots."""

    weight: float
    slots: int


class SlotSchedulers:
    def __init__(
        self, paths: tuple[SlotPath, ...], config: SchedulerConfig, block_manager: BlockManager
    ) -> None:
        if not paths or any(p.slots < 1 for p in paths):
            raise ValueError(f"need at least one path with at least one in-flight slot, got {paths}")
        self.config = config
        self.block_manager = block_manager
        self.paths = paths
        self.slots = [Scheduler(config, block_manager) for p in paths for _ in range(p.slots)]
        self.path_of_slot = [i for i, p in enumerate(paths) for _ in range(p.slots)]
        self.turns = WeightedTurns([p.weight for p in paths])
        self._slot_of: dict[int, int] = {}  # seq_id -> slot
        self.path_of_seq: dict[int, int] = {}

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

    @property
    def requests_per_path(self) -> list[int]:
        return list(self.turns.counts)

    def add(self, seq: Sequence) -> None:
        path = self.turns.next()
        self.path_of_seq[seq.seq_id] = path
        if isinstance(self.block_manager, PathBlockManagers):
            self.block_manager.assign(seq, path)
        mine = [s for s, p in enumerate(self.path_of_slot) if p == path]
        slot = min(mine, key=lambda i: (self.slots[i].num_unfinished, i))
        self._slot_of[seq.seq_id] = slot
        self.slots[slot].add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.slots[self._slot_of.pop(seq.seq_id)].finish(seq, reason)
        if isinstance(self.block_manager, PathBlockManagers):
            self.block_manager.forget(seq)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of its slot without finishing it (its blocks freed): a request moved to
        another executor (`LLMEngine.replace_executor`)."""
        slot = self.slots[self._slot_of.pop(seq.seq_id)]
        for queue in (slot.running, slot.waiting):
            if seq in queue:
                queue.remove(seq)
        self.block_manager.free(seq)
        self.path_of_seq.pop(seq.seq_id, None)
        if isinstance(self.block_manager, PathBlockManagers):
            self.block_manager.forget(seq)

    def schedule(self, slot: int = 0) -> SchedulerOutput:
        return self.slots[slot].schedule()

    def path_of(self, slot: int) -> int:
        return self.path_of_slot[slot]
