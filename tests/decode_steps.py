"""A sequence teacher-forced through the engine's runner: its prompt's first tokens in one prefill,
then one decode step per token (the steps the compiled CPU decode graph runs), and a wrapper that
counts the graph's steps."""

from __future__ import annotations

import contextlib

import torch

from tessel import LLM, SamplingParams
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence


class CountingGraph:
    """Wraps a CPU decode graph (`tessel.engine.cpu_graph.CpuGraph`): `rows` gets each step's row
    count; everything else is the graph's own."""

    def __init__(self, graph) -> None:
        self.graph, self.rows = graph, []

    def __call__(self, step):
        self.rows.append(step.positions.shape[0])
        return self.graph(step)

    def __getattr__(self, name: str):
        return getattr(self.graph, name)


@contextlib.contextmanager
def counted_graph(llm: LLM):
    """The engine's CPU graph wrapped while the block runs (-> the rows of its steps, [] without one)."""
    graph = llm.runner.cpu_graph
    if graph is None:
        yield []
        return
    counting = llm.runner.cpu_graph = CountingGraph(graph)
    try:
        yield counting.rows
    finally:
        llm.runner.cpu_graph = graph


def decode_logits(llm: LLM, ids: list[int], prefill: int) -> tuple[torch.Tensor, int]:
    """(logits of every position [len(ids), V], steps the engine's CPU graph ran): `prefill` tokens
    in one step, then one decode step per remaining token (prefill = len(ids): no decode)."""
    seq = Sequence("teacher-forced", ids, SamplingParams(temperature=0), llm.config.block_size)
    llm.block_manager.allocate(seq, 0)
    try:
        with counted_graph(llm) as runs:
            got = [llm.runner.forward_logits(SchedulerOutput(prefills=[(seq, prefill)]))]
            for seq.num_computed_tokens in range(prefill, len(ids)):
                got.append(llm.runner.forward_logits(SchedulerOutput(decodes=[seq])))
    finally:
        llm.block_manager.free(seq)
    return torch.cat(got), len(runs)


def batch_decode_logits(llm: LLM, prompts: list[list[int]], prefill: int) -> tuple[torch.Tensor, int]:
    """(logits [steps, rows, V], steps the engine's CPU graph ran): each sequence's first `prefill`
    tokens prefilled on its own, then one decode step per position for all of them at once
    (teacher-forced; the sequences have equal lengths)."""
    params, block_size = SamplingParams(temperature=0), llm.config.block_size
    seqs = [Sequence(f"row-{i}", ids, params, block_size) for i, ids in enumerate(prompts)]
    for seq in seqs:
        llm.block_manager.allocate(seq, 0)
    try:
        with counted_graph(llm) as runs:
            for seq in seqs:
                llm.runner.forward_logits(SchedulerOutput(prefills=[(seq, prefill)]))
            got = []
            for position in range(prefill, len(prompts[0])):
                for seq in seqs:
                    seq.num_computed_tokens = position
                got.append(llm.runner.forward_logits(SchedulerOutput(decodes=seqs)))
    finally:
        for seq in seqs:
            llm.block_manager.free(seq)
    return torch.stack(got), len(runs)
