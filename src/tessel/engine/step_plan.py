"""How a step runs: the one place that chooses eager, a CPU graph or a CUDA graph.

Once per runner, from the device, `enforce_eager` and the model, `graph_family` picks which graphs
exist at all:

    enforce_eager                              none: every step eager
    a CUDA device, max_num_seqs and max_model_len given, the whole model (not a pipeline stage)
                                               CUDA graphs (`tessel.engine.cuda_graph`)
    a CUDA device otherwise                    none
    the CPU                                    CPU graphs, as the model's layers allow:
        one row    `DecodeGraph` (`tessel.engine.decode_graph`), where every linear has a traced
                   one-row form (not oneDNN-packed float32, not fbgemm), float32 weights and cache
        several    `BatchDecodeGraph` (`tessel.engine.batch_decode_graph`), where some linear is
                   split (W8A8's quantiser and epilogue go into the graphs); with every linear called
                   whole the graphs would hold only the norms, rotary and activation, not worth
                   seconds of compiling per bucket of rows, so such models run eager

Then per step `StepPlan.mode` picks one `StepMode`:

    prefills in the step, or no decodes        EAGER
    CPU, one row, a one-row graph              CPU_ROW_GRAPH
    CPU, a batch graph (one row too where there is no one-row graph)   CPU_BATCH_GRAPH
    CUDA graphs and the step `fits` them       CUDA_GRAPH
    otherwise                                  EAGER

A mode whose graph failed to compile or capture (it warned once and ran the step eagerly) is
recorded in `failed`; its later steps run EAGER without trying again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tessel.engine.batch_decode_graph import BatchDecodeGraph
from tessel.engine.cuda_graph import CudaGraphDecoder
from tessel.engine.decode_graph import DecodeGraph
from tessel.layers.attention import AttentionMetadata
from tessel.layers.buckets import row_buckets
from tessel.models.llama import LlamaForCausalLM


class GraphFamily(enum.Enum):
    NONE = "none"
    CPU = "cpu"
    CUDA = "cuda"


class StepMode(enum.Enum):
    EAGER = "eager"
    CPU_ROW_GRAPH = "the compiled one-row decode step"
    CPU_BATCH_GRAPH = "the compiled batch decode step"
    CUDA_GRAPH = "the captured CUDA graph"


def capture_family(device: torch.device) -> GraphFamily:
    """The graphs `device` runs: CUDA graphs on a CUDA device, compiled CPU graphs on the CPU. The
    tests' hook: replaced there to run the CUDA graphs' bookkeeping on the CPU."""
    return GraphFamily.CUDA if device.type == "cuda" else GraphFamily.CPU


def graph_family(
    device: torch.device, enforce_eager: bool, whole_model: bool, cuda_sized: bool
) -> GraphFamily:
    """Which graphs a runner builds: none with `enforce_eager`; CUDA graphs only for a whole model
    (ids in, hidden out) with their buffers sized (`cuda_sized`: max_num_seqs and max_model_len)."""
    if enforce_eager:
        return GraphFamily.NONE
    family = capture_family(device)
    if family is GraphFamily.CUDA and not (whole_model and cuda_sized):
        return GraphFamily.NONE
    return family


@dataclass(slots=True)
class CudaSizes:
    """What the CUDA graphs' static buffers are sized for."""

    max_rows: int
    max_blocks: int
    block_size: int
    scratch_block: int  # the block past the block manager's pool that padded rows write into


@dataclass(slots=True)
class StepPlan:
    """The runner's graphs and, per step, the mode that runs it. The graph fields are the tests'
    hooks too (a test wraps or installs a graph by assigning it)."""

    row_graph: DecodeGraph | None = None
    batch_graph: BatchDecodeGraph | None = None
    cuda_graphs: CudaGraphDecoder | None = None
    failed: set[StepMode] = field(default_factory=set)

    @classmethod
    def build(cls, family: GraphFamily, model: LlamaForCausalLM, cuda: CudaSizes | None = None) -> StepPlan:
        """The graphs of `family` for `model` (its attention caches set): those its layers allow."""
        if family is GraphFamily.CPU:
            batch = BatchDecodeGraph.for_model(model)
            return cls(DecodeGraph.for_model(model), batch if batch_graph_pays(batch) else None)
        if family is GraphFamily.CUDA:
            if cuda is None:
                raise ValueError("CUDA graphs need their buffers' sizes")
            c = cuda
            graphs = CudaGraphDecoder(model, c.max_rows, c.max_blocks, c.block_size, c.scratch_block)
            return cls(cuda_graphs=graphs)
        return cls()

    def mode(self, meta: AttentionMetadata) -> StepMode:
        """How the step of `meta` runs."""
        rows = meta.num_decode_tokens
        if meta.prefills or rows == 0:
            return StepMode.EAGER
        if rows == 1 and self.row_graph is not None:
            return self._unless_failed(StepMode.CPU_ROW_GRAPH)
        if self.batch_graph is not None:
            return self._unless_failed(StepMode.CPU_BATCH_GRAPH)
        if self.cuda_graphs is not None and self.cuda_graphs.fits(meta):
            return self._unless_failed(StepMode.CUDA_GRAPH)
        return StepMode.EAGER

    def _unless_failed(self, mode: StepMode) -> StepMode:
        return StepMode.EAGER if mode in self.failed else mode

    def run(
        self,
        mode: StepMode,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        stream: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The step's hidden states from the graph of `mode`; None for EAGER, or where the graph
        failed to compile or capture (recorded: the mode's later steps are EAGER)."""
        if mode is StepMode.EAGER:
            return None
        if mode is StepMode.CUDA_GRAPH:
            hidden = self.cuda_graphs(input_ids, positions, meta)
        elif mode is StepMode.CPU_ROW_GRAPH:
            hidden = self.row_graph(input_ids, positions, meta, stream)
        else:
            hidden = self.batch_graph(input_ids, positions, meta, stream)
        if hidden is None:
            self.failed.add(mode)
        return hidden

    def warm_up_rows(self, max_rows: int) -> list[int]:
        """The row counts of the CPU decode steps that compile graphs, one per bucket of rows up to
        `max_rows`: one row for the one-row graph, every bucket of the batch graph (running
        `max_rows` rows compiles the bucket that holds them)."""
        rows = [1] if self.row_graph is not None else []
        if self.batch_graph is not None:
            rows += [b for b in row_buckets(max_rows) if b not in rows]
        return rows


def batch_graph_pays(graph: BatchDecodeGraph | None) -> bool:
    """Whether the engine compiles the batch graph: where some linear is split. With every linear
    called whole (float32, W8A16) the graphs hold only the norms, rotary and activation: the packed
    float32 engine's steps ran only slightly faster with them (`benchmarks/quant.py`, `fp32` against
    `fp32 eager`; docs/results.md), not worth seconds of compiling per bucket of rows
    (`benchmarks/decode_graph.py --rows 32`)."""
    return graph is not None and graph.splits_a_linear
