"""The one ladder of row buckets: the row counts a static-shape call is compiled, captured or padded for.

A ladder is the powers of two up to `step`, then the multiples of `step`:

    bucket_rows(rows, step)  the smallest rung holding `rows`
    row_buckets(max_rows, step)  every rung below `max_rows`, then `max_rows` itself (a capped ladder:
                             the buckets a step of at most `max_rows` rows can take)

Two steps are in use:

    BUCKET_STEP = 16         the decode graphs' rows: the CPU graph
                             (`tessel.engine.cpu_graph`, uncapped) and the CUDA graphs
                             (`tessel.engine.cuda_graph`, capped at `max_num_seqs`)
    PACKED_ROWS_STEP = 32    the rows of a packed float linear's oneDNN call (`tessel.layers.linear.dense`:
                             inputs cut into tiles of 256 rows, so a weight gets at most 13 shapes)

Capping changes only the top rung: for rows <= max_rows the capped bucket is
min(bucket_rows(rows, step), max_rows).
"""

from __future__ import annotations

BUCKET_STEP = 16
PACKED_ROWS_STEP = 32


def bucket_rows(rows: int, step: int = BUCKET_STEP) -> int:
    """The smallest rung holding `rows` (>= 1): 1, 2, 4, ..., step, then multiples of `step`."""
    if rows <= step:
        return 1 << (rows - 1).bit_length()
    return -(-rows // step) * step


def row_buckets(max_rows: int, step: int = BUCKET_STEP) -> list[int]:
    """The rungs below `max_rows`, then `max_rows`: the buckets of steps of 1 to `max_rows` rows."""
    rungs = sorted({bucket_rows(rows, step) for rows in range(1, max_rows + 1)})
    return [b for b in rungs if b < max_rows] + [max_rows]


def capped_bucket(rows: int, max_rows: int, step: int = BUCKET_STEP) -> int | None:
    """`rows`' bucket on the ladder capped at `max_rows`; None past `max_rows`."""
    return None if rows > max_rows else min(bucket_rows(rows, step), max_rows)
