"""Decode steps on a CUDA GPU replayed as captured CUDA graphs.

Eagerly, a decode step is one kernel launch per op from Python: for SmolLM2-135M's 30 layers that
is several hundred launches, and the GPU waits on the host. A captured graph replays the whole
step with one launch from the host (as vLLM and nano-vllm do), an order of magnitude faster at that
size (`benchmarks/cuda_engine.py`, its graph and eager rows; docs/results.md).

A graph has fixed shapes, so the step runs at a bucket of rows (`tessel.layers.buckets.row_buckets`:
1, 2, 4, 8, 16, then multiples of 16, capped at `max_num_seqs`), over static input buffers:

    input_ids, positions, slot_mapping  [rows]     (a later pipeline stage: the residual stream
                                                    [rows, hidden] it received, not input_ids)
    block_tables                        [rows, blocks of max_model_len]  (int32)
    context_lens                        [rows]                            (int32)

A step copies its rows in, pads the rest with a dummy row (token 0 at position 0, writing its k/v
into a scratch block past the block manager's pool and attending to that one token), replays, and
reads its rows of the static hidden states (a stage that is not the last: the stream to send on).
The table is always as wide as `max_model_len`, so the paged-decode kernel's launch (its context
splits) does not depend on the step.

Each bucket is captured the first time a step needs it, or all of them by `LLMEngine.warm_up()`
(which `tessel serve` calls before it listens): one eager run first (Triton compiles and the
autotuner picks its tiles outside the capture), then the capture into a memory pool shared by all
buckets. Which steps replay a graph is `tessel.engine.step_plan`'s choice (pure decode steps that
`fits`; prefills and mixed steps stay eager). A capture that fails warns once and the engine runs
eagerly from then on; `enforce_eager` turns the graphs off.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tessel.layers.attention import AttentionMetadata, DecodeGroup
from tessel.layers.buckets import capped_bucket, row_buckets
from tessel.models.llama import LlamaForCausalLM, StepInputs


@dataclass(slots=True)
class _Inputs:
    """The static buffers every graph reads (a bucket of rows reads their first rows)."""

    input_ids: torch.Tensor  # int64 [rows]; a later stage's residual stream [rows, hidden] instead
    positions: torch.Tensor  # int64 [rows]
    slot_mapping: torch.Tensor  # int64 [rows]
    block_tables: torch.Tensor  # int32 [rows, blocks of max_model_len]
    context_lens: torch.Tensor  # int32 [rows]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.positions, self.slot_mapping, self.block_tables, self.context_lens)


class CudaGraphDecoder:
    """Pure decode steps of up to `max_rows` sequences, each bucket of rows one captured graph."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        max_rows: int,
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        stream_dtype: torch.dtype | None = None,
    ) -> None:
        """`stream_dtype`: the activation dtype, for a pipeline stage after the first (its graphs read
        the residual stream it received instead of token ids)."""
        self.model = model
        self.buckets = row_buckets(max_rows)
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        self.takes_stream = not model.model.part.embed
        device = next(model.parameters()).device
        rows = self.buckets[-1]

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        first = zeros(rows)
        if self.takes_stream:
            first = zeros(rows, model.config.hidden_size, dtype=stream_dtype or torch.float32)
        self.inputs = _Inputs(
            first,
            zeros(rows),
            zeros(rows),
            zeros(rows, max_blocks, dtype=torch.int32),
            zeros(rows, dtype=torch.int32),
        )
        self.graphs: dict[int, tuple[Callable[[], object], torch.Tensor]] = {}  # rows -> (replay, hidden)
        self.pool = None  # one memory pool for every bucket's graph
        self.replays = 0  # steps that ran as a graph (tests, benchmarks)
        self.failed: str | None = None

    @torch.inference_mode()
    def capture_all(self) -> bool:
        """Capture every bucket now (largest first, so the smaller ones reuse its pool memory);
        -> whether all of them were captured."""
        for rows in reversed(self.buckets):
            if self.failed is not None or (rows not in self.graphs and self._capture(rows) is None):
                return False
        return True

    def bucket(self, rows: int) -> int | None:
        return capped_bucket(rows, self.buckets[-1])

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether a graph can run this step: decodes only (one decode group), at most `max_rows`
        rows, block tables no wider than the static ones, no failed capture."""
        return (
            self.failed is None
            and not meta.prefills
            and len(meta.decode_groups) == 1
            and self.bucket(meta.num_decode_tokens) is not None
            and meta.decode_groups[0].block_tables.shape[1] <= self.inputs.block_tables.shape[1]
        )

    def __call__(self, step: StepInputs) -> torch.Tensor | None:
        """The hidden states (or the stream to send on) of a step that `fits`, from its token ids or
        the residual `stream` a later stage received; None where its bucket's capture failed (a
        warning said why; `failed` then holds it)."""
        meta = step.meta
        rows = meta.num_decode_tokens
        bucket = self.bucket(rows)
        tables = meta.decode_groups[0].block_tables
        x = self.inputs
        x.input_ids[:rows].copy_(step.stream if self.takes_stream else step.input_ids)
        x.positions[:rows].copy_(step.positions)
        x.slot_mapping[:rows].copy_(meta.slot_mapping)
        x.block_tables[:rows, : tables.shape[1]].copy_(tables)
        x.context_lens[:rows].copy_(meta.decode_groups[0].context_lens)
        self._pad(rows, bucket)
        captured = self.graphs.get(bucket) or self._capture(bucket)
        if captured is None:
            return None
        replay, hidden = captured
        replay()
        self.replays += 1
        return hidden[:rows]

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) are dummies: token 0 at position 0, its k/v written into the scratch
        block, attending to that one token. Columns of a real row past its context are never read."""
        x = self.inputs
        x.input_ids[start:end].zero_()
        x.positions[start:end].zero_()
        x.slot_mapping[start:end].fill_(self.scratch_slot)
        x.block_tables[start:end, 0].fill_(self.scratch_block)
        x.context_lens[start:end].fill_(1)

    def _step(self, rows: int) -> StepInputs:
        """The model's inputs for a bucket: views of the static buffers (new views each call, as
        the CPU rotary caches its tables by the positions tensor's identity)."""
        x = self.inputs
        group = DecodeGroup(0, rows, x.block_tables[:rows], x.context_lens[:rows])
        meta = AttentionMetadata(x.slot_mapping[:rows], num_decode_tokens=rows, decode_groups=[group])
        if self.takes_stream:
            return StepInputs(x.positions[:rows], meta, stream=x.input_ids[:rows])
        return StepInputs(x.positions[:rows], meta, x.input_ids[:rows])

    def _capture(self, rows: int) -> tuple[Callable[[], object], torch.Tensor] | None:
        """Capture the bucket's graph on dummy rows (the step's own rows are put back after)."""
        saved = [t[:rows].clone() for t in self.inputs.tensors()]
        self._pad(0, rows)
        try:
            captured = self._record(lambda: self.model(self._step(rows)))
        except Exception as error:  # noqa: BLE001 (whatever failed, the step still runs, eagerly)
            self.failed = f"{type(error).__name__}: {error}"
            warnings.warn(
                f"capturing a {rows}-row decode step as a CUDA graph failed ({self.failed}); "
                "decoding eagerly from now on",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        finally:
            for tensor, values in zip(self.inputs.tensors(), saved, strict=True):
                tensor[:rows].copy_(values)
        self.graphs[rows] = captured
        return captured

    def _record(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], object], torch.Tensor]:
        """(replay, output) of `step` captured as a CUDA graph, after one eager run (Triton compiles
        and the autotuner picks its tiles there, outside the capture)."""
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = step()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, hidden
