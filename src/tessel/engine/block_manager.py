"""The KV block pool: free list, block tables, reference counts and prefix caching.

A full block whose k/v have been computed is registered under its key (hash of the previous
block's key, its token ids), so a later sequence with the same prefix shares it (ref count + 1)
instead of recomputing it. A block whose ref count drops to 0 returns to the free list but keeps
its key: it can be revived until it is handed out again (least recently freed first).

With `window_tokens` W (a model whose every layer has a sliding window, `ModelConfig.kv_window`), a
sequence's blocks wholly before the window of its next query go back to the pool as it proceeds
(`free_behind_window`): a query at position p reads keys in (p - W, p] only. Their block-table
entries become `FREED`, so entry i still covers tokens [i * block_size, (i + 1) * block_size). A
freed block keeps its prefix-cache key like any freed block: its KV is still that prefix's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tessel.engine.sequence import Sequence

BlockKey = tuple[int | None, tuple[int, ...]]
FREED = -1  # a block-table entry whose block went back to the pool (behind every layer's window)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window_tokens: int | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window_tokens = window_tokens
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockKey, int] = {}

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:  # evict it from the prefix cache
            if self.cached.get(block.key) == block_id:
                del self.cached[block.key]
            block.key = None
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None

    def num_prefix_hits(self, seq: Sequence) -> int:
        """How many leading full blocks of `seq` are in the prefix cache.

        The block holding the last token never counts: its logits must be computed.
        """
        if not self.enable_prefix_caching:
            return 0
        hits = 0
        for i in range((len(seq) - 1) // self.block_size):
            if seq.block_key(i) not in self.cached:
                break
            hits += 1
        return hits

    def can_allocate(self, seq: Sequence, hits: int) -> bool:
        revived = sum(1 for i in range(hits) if self.blocks[self.cached[seq.block_key(i)]].ref_count == 0)
        new = seq.num_blocks_for(len(seq)) - hits
        return new + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, hits: int) -> None:
        """Give a waiting `seq` blocks for all its tokens, the first `hits` from the prefix cache."""
        assert not seq.block_table, "sequence already has blocks"
        for i in range(hits):
            block_id = self.cached[seq.block_key(i)]
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(seq.num_blocks_for(len(seq)) - hits):
            seq.block_table.append(self._take_free_block())
        seq.num_computed_tokens = hits * self.block_size
        seq.num_registered_blocks = hits
        seq.metrics = seq.metrics.but(num_cached_tokens=hits * self.block_size)

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq`'s block table cover `num_tokens` tokens; False (and no change) if the pool is short."""
        need = -(-num_tokens // seq.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if need > len(self.free_blocks):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free_block())
        return True

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s blocks. Tail blocks go first into the free list, so they are evicted first."""
        for block_id in reversed(seq.block_table):
            if block_id != FREED:
                self._release(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def free_behind_window(self, seq: Sequence) -> int:
        """Return `seq`'s blocks that no later query reads (every key at or before position
        num_computed_tokens - window_tokens) to the pool; -> how many now. Call after
        `register_computed_blocks`."""
        if self.window_tokens is None:
            return 0
        first_read = seq.num_computed_tokens - self.window_tokens + 1  # the next query's first key
        behind = min(max(first_read, 0) // self.block_size, len(seq.block_table))
        if not behind or seq.block_table[behind - 1] == FREED:
            return 0
        table = list(seq.block_table)  # a new list: a table changes in place only by appends (DecodeRows)
        freed = 0
        for i in range(behind - 1, -1, -1):  # the freed entries are a prefix of the table
            if table[i] == FREED:
                break
            self._release(table[i])
            table[i] = FREED
            freed += 1
        seq.block_table = table
        return freed

    def commit_computed(self, seqs: list[Sequence]) -> None:
        """After a step computed tokens of `seqs`: each one's newly full blocks into the prefix cache
        (`register_computed_blocks`) and its blocks behind the window back to the pool
        (`free_behind_window`); a sequence with neither to do costs one comparison."""
        if self.enable_prefix_caching:
            bs = self.block_size
            # a block may be full only where the computed tokens are past the registered blocks
            past = [seq for seq in seqs if seq.num_computed_tokens // bs > seq.num_registered_blocks]
            for seq in past:
                if min(seq.num_computed_tokens, len(seq.token_ids)) // bs > seq.num_registered_blocks:
                    self.register_computed_blocks(seq)
        if self.window_tokens is not None:
            for seq in seqs:
                self.free_behind_window(seq)

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Put `seq`'s full blocks whose k/v are now computed into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, len(seq)) // self.block_size
        for i in range(seq.num_registered_blocks, full):
            key = seq.block_key(i)
            block = self.blocks[seq.block_table[i]]
            if key not in self.cached and block.key is None:
                self.cached[key] = block.block_id
                block.key = key
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)


class RangeBlockManager(BlockManager):
    """A `BlockManager` whose block ids are [start, end) (no prefix cache)."""

    def __init__(self, start: int, end: int, block_size: int) -> None:
        super().__init__(end - start, block_size, enable_prefix_caching=False)
        self.start = start
        self.free_blocks = OrderedDict((start + i, None) for i in range(end - start))

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        self.blocks[block_id - self.start].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id - self.start]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block_id] = None


class PathBlockManagers:
    """The block manager of an engine whose executor runs several paths (a flow plan): one id range
    per path (`ranges`), each sequence's blocks from its path's range (`assign` first); what the
    engine reads of one block manager. No prefix cache: a cached block's KV is only on the
    placements of the path that computed it."""

    def __init__(self, ranges: list[tuple[int, int]], block_size: int) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = False
        self.managers = [RangeBlockManager(a, b, block_size) for a, b in ranges]
        self._path_of: dict[int, int] = {}
        self._default = min(range(len(ranges)), key=lambda i: ranges[i][0])  # ids from 0: rank 0 holds them

    def assign(self, seq: Sequence, path: int) -> None:
        self._path_of[seq.seq_id] = path

    def forget(self, seq: Sequence) -> None:
        self._path_of.pop(seq.seq_id, None)

    def _of(self, seq: Sequence) -> BlockManager:
        return self.managers[self._path_of.get(seq.seq_id, self._default)]

    @property
    def num_total_blocks(self) -> int:
        return sum(m.num_total_blocks for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    def num_prefix_hits(self, seq: Sequence) -> int:
        return 0

    def can_allocate(self, seq: Sequence, hits: int) -> bool:
        return self._of(seq).can_allocate(seq, hits)

    def allocate(self, seq: Sequence, hits: int) -> None:
        self._of(seq).allocate(seq, hits)

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        return self._of(seq).reserve(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        self._of(seq).free(seq)

    def commit_computed(self, seqs: list[Sequence]) -> None:
        return None

    def register_computed_blocks(self, seq: Sequence) -> None:
        return None

    def free_behind_window(self, seq: Sequence) -> int:
        return 0
