"""The decode rows kept across steps (`DecodeRows`) against the inputs built afresh from each
sequence's block table (the oracle: what `ModelRunner.prepare` built before issue 47), over random
steps where sequences join, leave, grow their tables, are preempted (a new table), free blocks
behind a window and come back, and where the same sequence fills several rows."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tessel.engine.block_manager import FREED
from tessel.engine.decode_rows import DecodeRows
from tessel.engine.sampling_params import SamplingParams
from tessel.engine.sequence import Sequence


def fresh(seqs: list[Sequence], block_size: int) -> dict:
    """The step's decode inputs as the runner built them before: from each table, padded with 0."""
    positions = [seq.num_computed_tokens for seq in seqs]
    lens = [p + 1 for p in positions]
    width = max(-(-n // block_size) for n in lens)
    tables = [[b if b != FREED else 0 for b in seq.block_table[:width]] for seq in seqs]
    return {
        "input_ids": [seq.token_ids[p] for seq, p in zip(seqs, positions, strict=True)],
        "positions": positions,
        "slots": [
            seq.block_table[p // block_size] * block_size + p % block_size
            for seq, p in zip(seqs, positions, strict=True)
        ],
        "block_tables": [t + [0] * (width - len(t)) for t in tables],
        "context_lens": lens,
        "sample_rows": [
            i for i, (seq, p) in enumerate(zip(seqs, positions, strict=True)) if p + 1 == len(seq)
        ],
    }


def kept(rows: DecodeRows, seqs: list[Sequence]) -> dict:
    found = rows.inputs(seqs)
    return {
        "input_ids": found.input_ids,
        "positions": found.positions,
        "slots": found.slots,
        "block_tables": found.block_tables.tolist(),
        "context_lens": found.context_lens,
        "sample_rows": found.sample_rows,
    }


class Pool:
    """Random block ids for the sequences' tables (distinct while held, as the block manager's)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.free = list(range(1, 10_000))
        rng.shuffle(self.free)

    def take(self) -> int:
        return self.free.pop()


def new_seq(rng: random.Random, pool: Pool, block_size: int) -> Sequence:
    prompt = [rng.randrange(100) for _ in range(rng.randint(1, 3 * block_size))]
    seq = Sequence("r", prompt, SamplingParams(), block_size)
    seq.block_table = [pool.take() for _ in range(seq.num_blocks_for(len(prompt)))]
    seq.num_computed_tokens = len(prompt) - 1
    return seq


def advance(seq: Sequence, rng: random.Random, pool: Pool) -> None:
    """One decode step done: a token appended, a block appended at a boundary (the list grows)."""
    seq.num_computed_tokens += 1
    seq.token_ids.append(rng.randrange(100))
    while len(seq.block_table) < seq.num_blocks_for(len(seq.token_ids)):
        seq.block_table.append(pool.take())


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_rows_equal_fresh_inputs_after_random_joins_and_leaves(block_size, seed):
    rng = random.Random(seed)
    pool = Pool(rng)
    rows = DecodeRows(block_size)
    live = [new_seq(rng, pool, block_size) for _ in range(rng.randint(1, 5))]
    for _ in range(300):
        event = rng.random()
        if event < 0.15:  # joins
            live += [new_seq(rng, pool, block_size) for _ in range(rng.randint(1, 8))]
        elif event < 0.25 and len(live) > 1:  # leaves
            for _ in range(rng.randint(1, len(live) - 1)):
                live.pop(rng.randrange(len(live)))
        elif event < 0.30:  # preempted and back: a new table, maybe as long as the old one
            seq = rng.choice(live)
            seq.block_table = [pool.take() for _ in seq.block_table]
        elif event < 0.35:  # blocks behind a window freed: a new list with FREED entries first
            seq = rng.choice(live)
            behind = rng.randint(0, len(seq.block_table) - 1)
            seq.block_table = [FREED] * behind + seq.block_table[behind:]
        elif event < 0.40:  # the order changes
            rng.shuffle(live)
        step = list(live)
        if rng.random() < 0.1:  # one sequence in several rows (the warm-up's dummy rows)
            step += [step[0]] * rng.randint(1, 3)
        if rng.random() < 0.1:  # a sequence whose last token is not the step's (no sample row)
            seq = rng.choice(step)
            seq.token_ids.append(rng.randrange(100))
            while len(seq.block_table) < seq.num_blocks_for(len(seq.token_ids)):
                seq.block_table.append(pool.take())
        assert kept(rows, step) == fresh(step, block_size)
        for seq in set(step):
            advance(seq, rng, pool)


def test_rows_of_sequences_gone_are_reused_and_the_array_grows_when_short():
    rng = random.Random(3)
    pool = Pool(rng)
    rows = DecodeRows(4)
    first = [new_seq(rng, pool, 4) for _ in range(6)]
    assert kept(rows, first) == fresh(first, 4)
    held = rows.tables.shape[0]
    second = [new_seq(rng, pool, 4) for _ in range(6)]  # the first six are gone: their rows serve
    assert kept(rows, second) == fresh(second, 4)
    assert rows.tables.shape[0] == held
    many = second + [new_seq(rng, pool, 4) for _ in range(3 * held)]
    assert kept(rows, many) == fresh(many, 4)
    assert rows.tables.shape[0] >= len(many)


def test_a_steady_batch_reuses_its_block_tables_until_a_row_changes():
    rng = random.Random(4)
    pool = Pool(rng)
    rows = DecodeRows(64)
    seqs = [new_seq(rng, pool, 64) for _ in range(5)]
    for seq in seqs:
        seq.num_computed_tokens = len(seq.token_ids) - 1
    first = rows.inputs(seqs).block_tables
    assert rows.inputs(seqs).block_tables is first  # nothing changed: the same array
    seqs[2].block_table = [pool.take() for _ in seqs[2].block_table]
    again = rows.inputs(seqs).block_tables
    assert again is not first and np.array_equal(again[2, : len(seqs[2].block_table)], seqs[2].block_table)
