"""Property tests: BlockManager + Scheduler over random request streams with aborts.

A fake model appends a random token to every sequence whose step completes it. After every
step: each block is either free (ref 0, in the free list once) or held by exactly `ref_count`
block-table entries; a cached block's key matches the tokens of every sequence holding it at that
position; and when all requests are done every block is free again.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tessel.engine.block_manager import FREED, BlockManager
from tessel.engine.sampling_params import SamplingParams
from tessel.engine.scheduler import Scheduler, SchedulerConfig
from tessel.engine.sequence import Sequence, SequenceStatus


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    held = Counter(b for seq in live for b in seq.block_table if b != FREED)
    assert len(bm.free_blocks) == len(set(bm.free_blocks))
    for block in bm.blocks:
        assert block.ref_count == held[block.block_id], f"block {block.block_id}"
        assert (block.ref_count == 0) == (block.block_id in bm.free_blocks)
    for key, block_id in bm.cached.items():
        assert bm.blocks[block_id].key == key
    for seq in live:
        table = [b for b in seq.block_table if b != FREED]
        assert len(set(table)) == len(table)
        assert seq.block_table[: len(seq.block_table) - len(table)] == [FREED] * (
            len(seq.block_table) - len(table)
        )
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
        if bm.window_tokens is not None:  # every block a later query reads is still held
            first_read = max(0, seq.num_computed_tokens - bm.window_tokens + 1)
            assert FREED not in seq.block_table[first_read // bm.block_size :]
        for i, block_id in enumerate(seq.block_table[: seq.num_computed_tokens // bm.block_size]):
            if block_id == FREED:
                continue
            key = bm.blocks[block_id].key
            assert key is None or key == seq.block_key(i), "a sequence shares a block with other tokens"


def run_stream(
    seed: int,
    num_requests: int,
    num_blocks: int,
    block_size: int,
    budget: int,
    max_num_seqs: int,
    prefix_caching: bool,
    abort_rate: float,
    window_tokens: int | None = None,
) -> tuple[BlockManager, Scheduler]:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, prefix_caching, window_tokens)
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget, enable_chunked_prefill=True), bm)
    max_len = num_blocks * block_size
    todo = []
    for i in range(num_requests):
        prompt = [
            rng.randrange(3) for _ in range(rng.randint(1, max(1, max_len // 2)))
        ]  # few symbols: shared prefixes
        max_tokens = rng.randint(1, max(1, max_len - len(prompt)))
        todo.append(Sequence(str(i), prompt, SamplingParams(max_tokens=max_tokens), block_size))
    live: list[Sequence] = []
    for _ in range(10_000):
        if todo and rng.random() < 0.5:
            seq = todo.pop()
            sched.add(seq)
            live.append(seq)
        if live and rng.random() < abort_rate:
            victim = rng.choice(live)
            sched.finish(victim, "abort")
            live.remove(victim)
        out = sched.schedule()
        scheduled = out.scheduled()
        assert out.num_tokens <= budget
        assert len(sched.running) <= max_num_seqs
        for seq, n in scheduled:
            assert seq.status is SequenceStatus.RUNNING
            assert 1 <= n <= len(seq) - seq.num_computed_tokens
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            bm.register_computed_blocks(seq)
            bm.free_behind_window(seq)
            if seq.num_computed_tokens == len(seq):
                seq.append_token(rng.randrange(3))
                if seq.num_output_tokens >= seq.max_tokens:
                    sched.finish(seq, "length")
                    live.remove(seq)
        check_invariants(bm, live)
        if not todo and not live:
            break
    assert not todo and not live, "requests left after 10,000 steps: the scheduler is stuck"
    return bm, sched


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    num_requests=st.integers(1, 12),
    num_blocks=st.integers(2, 24),
    block_size=st.sampled_from([1, 2, 3, 4, 16]),
    budget=st.integers(1, 40),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    abort_rate=st.sampled_from([0.0, 0.05, 0.3]),
)
def test_no_block_leaks_or_double_frees_over_random_streams(
    seed, num_requests, num_blocks, block_size, budget, max_num_seqs, prefix_caching, abort_rate
) -> None:
    bm, _ = run_stream(
        seed, num_requests, num_blocks, block_size, budget, max_num_seqs, prefix_caching, abort_rate
    )
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    num_requests=st.integers(1, 12),
    num_blocks=st.integers(2, 24),
    block_size=st.sampled_from([1, 2, 3, 4, 16]),
    budget=st.integers(1, 40),
    prefix_caching=st.booleans(),
    window_tokens=st.sampled_from([1, 2, 5, 8, 33]),
)
def test_blocks_behind_a_sliding_window_go_back_without_leaks(
    seed, num_requests, num_blocks, block_size, budget, prefix_caching, window_tokens
) -> None:
    """With every layer windowed, blocks behind the next query's window return to the pool as the
    sequences proceed; the invariants above hold (the freed entries a prefix of each table, every
    block a later query reads still held, cached keys intact) and nothing leaks."""
    bm, _ = run_stream(
        seed, num_requests, num_blocks, block_size, budget, 4, prefix_caching, 0.05, window_tokens
    )
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_free_behind_window_keeps_the_blocks_the_next_query_reads() -> None:
    """W = 6, blocks of 4: after c computed tokens the next query (position c) reads keys c - 5 .. c,
    so block i goes once 4 (i + 1) <= c - 5."""
    bm = BlockManager(10, 4, enable_prefix_caching=True, window_tokens=6)
    seq = Sequence("a", list(range(30)), SamplingParams(), 4)
    bm.allocate(seq, 0)
    freed = []
    for c in range(1, 31):
        seq.num_computed_tokens = c
        bm.register_computed_blocks(seq)
        freed.append(bm.free_behind_window(seq))
        assert seq.block_table.count(FREED) == max(0, c - 5) // 4
    assert sum(freed) == 6 and bm.num_free_blocks == 10 - 8 + 6
    bm.free(seq)
    assert bm.num_free_blocks == 10 and all(b.ref_count == 0 for b in bm.blocks)
    again = Sequence("b", list(range(30)), SamplingParams(), 4)  # the freed blocks keep their keys
    assert bm.num_prefix_hits(again) == 7


def test_a_tight_pool_preempts_and_still_finishes() -> None:
    _, sched = run_stream(0, 10, 6, 2, 16, 6, prefix_caching=False, abort_rate=0.0)
    assert sched.num_preemptions > 0


def test_prefix_hits_share_blocks_and_skip_computed_tokens() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = Sequence("a", list(range(10)), SamplingParams(), 4)
    bm.allocate(a, bm.num_prefix_hits(a))
    assert a.num_computed_tokens == 0 and len(a.block_table) == 3
    a.num_computed_tokens = 10
    bm.register_computed_blocks(a)  # blocks 0-1 are full and computed; block 2 holds 2 tokens
    b = Sequence("b", list(range(9)) + [99, 98], SamplingParams(), 4)
    hits = bm.num_prefix_hits(b)
    assert hits == 2
    bm.allocate(b, hits)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16
    c = Sequence("c", list(range(8)), SamplingParams(), 4)  # exactly two blocks: the last is recomputed
    assert bm.num_prefix_hits(c) == 1


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(), 2)
    bm.allocate(a, 0)
    a.num_computed_tokens = 5
    bm.register_computed_blocks(a)
    assert not bm.cached
    assert bm.num_prefix_hits(Sequence("b", [1, 2, 3, 4, 5], SamplingParams(), 2)) == 0
