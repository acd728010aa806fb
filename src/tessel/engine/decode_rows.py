"""The decode rows' inputs, with their block tables kept from step to step (vLLM's persistent batch).

A step's decode rows need each sequence's position, last token, cache slot and block table. The
first three change every step and cost one attribute read each; the block table (up to
max_model_len / block_size entries) changes only when the sequence joins, crosses a block boundary,
is preempted or frees blocks behind its window. So each sequence keeps a row of `tables`, a numpy
copy of its block table (`FREED` entries as block 0, zeros past its end): a step writes only the
rows whose table changed (a new `block_table` list, or the same list longer: `Sequence` grows its
table by appends and replaces the list for any other change), and the step's block tables are one
gather of its rows, or the last step's array again when its rows, their contents and the width are
the same (a steady decode batch between block boundaries).

Rows are keyed by `seq_id`. When every row is taken, the rows of sequences outside the step are
dropped (they are written afresh if they come back) or, if the step needs more, the array grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessel.engine.block_manager import FREED
from tessel.engine.sequence import Sequence


@dataclass(slots=True)
class DecodeInputs:
    """A step's decode rows, in order: one token each."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # cache slot of each row's token
    block_tables: np.ndarray  # int32 [B, blocks]: padded with block 0
    context_lens: list[int]
    sample_rows: list[int]  # rows whose token is their sequence's last (their logits are sampled)


class DecodeRows:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.tables = np.zeros((0, 1), dtype=np.int32)
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._copied: list[list[int] | None] = []  # per row: the block_table list it copies
        self._lengths: list[int] = []  # per row: how many entries of that list it holds
        self._free: list[int] = []
        # the last step's rows, width and block tables: the same rows, unwritten, reuse them
        self._last: tuple[list[int], int, np.ndarray] = ([], 0, np.zeros((0, 0), dtype=np.int32))

    def inputs(self, seqs: list[Sequence]) -> DecodeInputs:
        """The inputs of `seqs` (at least one) decoding one token each, their rows brought up to date
        first. A few list comprehensions and one numpy gather: numpy's per-call cost is the larger
        one at a few rows, and a step's token slot is one list index per row."""
        bs = self.block_size
        positions = [seq.num_computed_tokens for seq in seqs]
        context_lens = [pos + 1 for pos in positions]
        input_ids = [seq.token_ids[pos] for seq, pos in zip(seqs, positions, strict=True)]
        slots = [seq.block_table[pos // bs] * bs + pos % bs for seq, pos in zip(seqs, positions, strict=True)]
        if context_lens == [len(seq.token_ids) for seq in seqs]:  # every row's token is its last
            sample_rows = list(range(len(seqs)))
        else:
            ends = zip(seqs, context_lens, strict=True)
            sample_rows = [i for i, (seq, end) in enumerate(ends) if end == len(seq.token_ids)]
        rows, written = self.rows(seqs)  # first: it may grow `tables`
        width = max(positions) // bs + 1
        if written or width != self._last[1] or rows != self._last[0]:
            self._last = (rows, width, self.tables[np.array(rows, dtype=np.int64), :width])
        return DecodeInputs(input_ids, positions, slots, self._last[2], context_lens, sample_rows)

    def rows(self, seqs: list[Sequence]) -> tuple[list[int], bool]:
        """The rows of `seqs`, each holding its sequence's block table; -> (rows, whether any was
        written)."""
        row_of, copied, lengths = self._row_of, self._copied, self._lengths
        rows = [row_of.get(seq.seq_id, -1) for seq in seqs]
        stale = [
            i
            for i, (seq, row) in enumerate(zip(seqs, rows, strict=True))
            if row < 0 or copied[row] is not seq.block_table or lengths[row] != len(seq.block_table)
        ]
        for i in stale:
            seq = seqs[i]
            row = rows[i] if rows[i] >= 0 else row_of.get(seq.seq_id, -1)  # a repeated seq: its row now
            if row < 0:
                row = self._take_row(seqs)
                row_of[seq.seq_id] = row
            self._write(row, seq.block_table)
            rows[i] = row
        return rows, bool(stale)

    def _write(self, row: int, table: list[int]) -> None:
        """Row `row` as `table`: only its new entries where it is the same list, grown."""
        grown = self._copied[row] is table and self._lengths[row] <= len(table)
        start = self._lengths[row] if grown else 0
        if len(table) > self.tables.shape[1]:
            self._grow(self.tables.shape[0], max(len(table), 2 * self.tables.shape[1]))
        entries = np.array(table[start:], dtype=np.int32)
        entries[entries == FREED] = 0
        self.tables[row, start : len(table)] = entries
        if start == 0:
            self.tables[row, len(table) :] = 0
        self._copied[row], self._lengths[row] = table, len(table)

    def _take_row(self, step: list[Sequence]) -> int:
        """A free row; when none is, the rows of sequences outside `step` are freed, or more added."""
        if not self._free:
            keep = {seq.seq_id for seq in step}
            for seq_id in [s for s in self._row_of if s not in keep]:
                row = self._row_of.pop(seq_id)
                self._free.append(row)
                self._copied[row], self._lengths[row] = None, 0
            if len(self._free) < len(step):
                rows = self.tables.shape[0]
                self._grow(max(2 * rows, rows + len(step)), self.tables.shape[1])
        return self._free.pop()

    def _grow(self, rows: int, width: int) -> None:
        old_rows, old_width = self.tables.shape
        tables = np.zeros((rows, width), dtype=np.int32)
        tables[:old_rows, :old_width] = self.tables
        self.tables = tables
        self._copied += [None] * (rows - old_rows)
        self._lengths += [0] * (rows - old_rows)
        self._free += range(rows - 1, old_rows - 1, -1)
