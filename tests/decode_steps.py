"""A sequence teacher-forced through the engine's runner: its prompt's first tokens in one prefill,
then one decode step per token (the steps the compiled one-sequence decode graph runs)."""

from __future__ import annotations

import torch

from tessel import LLM, SamplingParams
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence


def decode_logits(llm: LLM, ids: list[int], prefill: int) -> tuple[torch.Tensor, int]:
    """(logits of every position [len(ids), V], steps the engine's decode graph ran): `prefill`
    tokens in one step, then one decode step per remaining token (prefill = len(ids): no decode)."""
    graph, runs = llm.runner.decode_graph, []
    if graph is not None:
        llm.runner.decode_graph = lambda *args: runs.append(1) or graph(*args)
    seq = Sequence("teacher-forced", ids, SamplingParams(temperature=0), llm.config.block_size)
    llm.block_manager.allocate(seq, 0)
    try:
        got = [llm.runner.forward_logits(SchedulerOutput(prefills=[(seq, prefill)]))]
        for seq.num_computed_tokens in range(prefill, len(ids)):
            got.append(llm.runner.forward_logits(SchedulerOutput(decodes=[seq])))
    finally:
        llm.runner.decode_graph = graph
        llm.block_manager.free(seq)
    return torch.cat(got), len(runs)


def batch_decode_logits(llm: LLM, prompts: list[list[int]], prefill: int) -> tuple[torch.Tensor, int]:
    """(logits [steps, rows, V], steps the engine's batch decode graph ran): each sequence's first
    `prefill` tokens prefilled on its own, then one decode step per position for all of them at
    once (teacher-forced; the sequences have equal lengths)."""
    graph, runs = llm.runner.batch_decode_graph, []
    if graph is not None:
        llm.runner.batch_decode_graph = lambda *args: runs.append(1) or graph(*args)
    params, block_size = SamplingParams(temperature=0), llm.config.block_size
    seqs = [Sequence(f"row-{i}", ids, params, block_size) for i, ids in enumerate(prompts)]
    for seq in seqs:
        llm.block_manager.allocate(seq, 0)
    try:
        for seq in seqs:
            llm.runner.forward_logits(SchedulerOutput(prefills=[(seq, prefill)]))
        got = []
        for position in range(prefill, len(prompts[0])):
            for seq in seqs:
                seq.num_computed_tokens = position
            got.append(llm.runner.forward_logits(SchedulerOutput(decodes=seqs)))
    finally:
        llm.runner.batch_decode_graph = graph
        for seq in seqs:
            llm.block_manager.free(seq)
    return torch.stack(got), len(runs)
