"""How a step runs: the one place that chooses eager, a CPU graph or a CUDA graph.

Once per runner, from the device, `enforce_eager` and the model, `graph_family` picks which graphs
exist at all:

    enforce_eager                              none: every step eager
    a CUDA device, max_num_seqs and max_model_len given (the whole model or a pipeline stage)
                                               CUDA graphs (`tessel.engine.cuda_graph`)
    a CUDA device otherwise, or a model with
    routed experts or a sliding window         none
    the CPU                                    the compiled CPU graph (`tessel.engine.cpu_graph`)
                                               where the model's layers allow one: float32 weights
                                               and cache, Llama layers with RMSNorms

Then per step `StepPlan.mode` picks one `StepMode`:

    prefills in the step, or no decodes        EAGER
    CPU, the graph `takes` the step's rows     CPU_GRAPH: one row where every linear has a traced
                                               one-row form (not oneDNN-packed float32, not fbgemm),
                                               any row count where some linear is split (W8A8's
                                               quantiser and epilogue go into the graphs); with every
                                               linear called whole the graphs would hold only the
                                               norms, rotary and activation, not worth seconds of
                                               compiling per bucket of rows, so those steps run eager
    CUDA graphs and the step `fits` them       CUDA_GRAPH
    otherwise                                  EAGER

A mode whose graph failed to compile or capture (it warned once and ran the step eagerly) is
recorded in `failed`; its later steps run EAGER without trying again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tessel.engine.cpu_graph import CpuGraph
from tessel.engine.cuda_graph import CudaGraphDecoder
from tessel.layers.attention import AttentionMetadata
from tessel.layers.buckets import row_buckets
from tessel.models.llama import LlamaForCausalLM, StepInputs


class GraphFamily(enum.Enum):
    NONE = "none"
    CPU = "cpu"
    CUDA = "cuda"


class StepMode(enum.Enum):
    EAGER = "eager"
    CPU_GRAPH = "the compiled decode step"
    CUDA_GRAPH = "the captured CUDA graph"


def capture_family(device: torch.device) -> GraphFamily:
    """The graphs `device` runs: CUDA graphs on a CUDA device, compiled CPU graphs on the CPU. The
    tests' hook: replaced there to run the CUDA graphs' bookkeeping on the CPU."""
    return GraphFamily.CUDA if device.type == "cuda" else GraphFamily.CPU


def graph_family(device: torch.device, enforce_eager: bool, cuda_sized: bool) -> GraphFamily:
    """Which graphs a runner builds: none with `enforce_eager`; CUDA graphs only with their buffers
    sized (`cuda_sized`: max_num_seqs and max_model_len)."""
    if enforce_eager:
        return GraphFamily.NONE
    family = capture_family(device)
    if family is GraphFamily.CUDA and not cuda_sized:
        return GraphFamily.NONE
    return family


@dataclass(slots=True)
class CudaSizes:
    """What the CUDA graphs' static buffers are sized for."""

    max_rows: int
    max_blocks: int
    block_size: int
    scratch_block: int  # the block past the block manager's pool that padded rows write into
    stream_dtype: torch.dtype | None = None  # a later pipeline stage's activation dtype


@dataclass(slots=True)
class StepPlan:
    """The runner's graphs and, per step, the mode that runs it. The graph fields are the tests'
    hooks too (a test wraps or installs a graph by assigning it)."""

    cpu_graph: CpuGraph | None = None
    cuda_graphs: CudaGraphDecoder | None = None
    failed: set[StepMode] = field(default_factory=set)

    @classmethod
    def build(cls, family: GraphFamily, model: LlamaForCausalLM, cuda: CudaSizes | None = None) -> StepPlan:
        """The graphs of `family` for `model` (its attention caches set): those its layers allow."""
        if family is GraphFamily.CPU:
            return cls(cpu_graph=CpuGraph.for_model(model))
        if family is GraphFamily.CUDA and not _capturable(model):
            return cls()
        if family is GraphFamily.CUDA:
            if cuda is None:
                raise ValueError("CUDA graphs need their buffers' sizes")
            c = cuda
            graphs = CudaGraphDecoder(
                model, c.max_rows, c.max_blocks, c.block_size, c.scratch_block, c.stream_dtype
            )
            return cls(cuda_graphs=graphs)
        return cls()

    def mode(self, meta: AttentionMetadata) -> StepMode:
        """How the step of `meta` runs."""
        rows = meta.num_decode_tokens
        if meta.prefills or rows == 0:
            return StepMode.EAGER
        if self.cpu_graph is not None and self.cpu_graph.takes(rows):
            return self._unless_failed(StepMode.CPU_GRAPH)
        if self.cuda_graphs is not None and self.cuda_graphs.fits(meta):
            return self._unless_failed(StepMode.CUDA_GRAPH)
        return StepMode.EAGER

    def _unless_failed(self, mode: StepMode) -> StepMode:
        return StepMode.EAGER if mode in self.failed else mode

    def run(self, mode: StepMode, step: StepInputs) -> torch.Tensor | None:
        """The step's hidden states from the graph of `mode`; None for EAGER, or where the graph
        failed to compile or capture (recorded: the mode's later steps are EAGER)."""
        if mode is StepMode.EAGER:
            return None
        if mode is StepMode.CUDA_GRAPH:
            hidden = self.cuda_graphs(step)
        else:
            hidden = self.cpu_graph(step)
        if hidden is None:
            self.failed.add(mode)
        return hidden

    def warm_up_rows(self, max_rows: int) -> list[int]:
        """The row counts of the CPU decode steps that compile graphs, one per bucket of rows up to
        `max_rows` that the graph takes (running `max_rows` rows compiles the bucket that holds them)."""
        if self.cpu_graph is None:
            return []
        return [rows for rows in row_buckets(max_rows) if self.cpu_graph.takes(rows)]


def _capturable(model: LlamaForCausalLM) -> bool:
    """Whether a decode step can be captured: routed experts and sliding windows size their work on
    the host from the step's data (expert counts, window starts), which a CUDA graph cannot replay."""
    config = getattr(model, "config", None)
    return config is None or not (config.num_experts or config.sliding_window)
