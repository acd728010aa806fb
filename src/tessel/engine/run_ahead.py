"""Async scheduling: the next decode step prepared while the current one computes, and launched the
moment its tokens are sampled, before they are applied (vLLM's async scheduling).

An engine with an overlapping executor (`LocalExecutor(overlap=True)`, the `async_scheduling`
setting) computes a decode step on a worker thread. While it runs, the engine prepares the step after
it for the same sequences as if each already had its next token (one more token, one more computed,
undone after `ModelRunner.prepare`); when the step's tokens come back they become the next step's
input ids and that step starts; only then are the tokens applied (stop rules, outputs, the caller's
own work), in parallel with the step now running. Per step the host's critical path is the wait, the
fill of the input ids and the launch; preparing, applying and detokenising overlap the forward.

A sequence that stops on the token just applied (EOS, a stop string) has already been launched into
the next step: its row there is computed and dropped, and its blocks, freed when it stopped, are only
handed out again by a schedule, which runs when no step is in flight. A sequence whose next token is
its last by length is left out of the next step beforehand.

The engine runs ahead only where the next step is certain to be the same decode batch: every running
sequence in it, nothing waiting that could be admitted, no prefill, no prompt scoring, no guided
decoding, no abort pending, blocks free for every row that crosses a block boundary. Otherwise it
waits for the step, applies it and schedules as usual, so a request that arrives while decode steps
run ahead is admitted one step later than without (as in vLLM).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tessel.engine.model_runner import ModelRunner, Prepared, StepResult
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from tessel.engine.executor import InFlightBatch
    from tessel.engine.llm_engine import LLMEngine


def ahead_seqs(engine: LLMEngine, micro: InFlightBatch) -> list[Sequence] | None:
    """The sequences of the decode step after `micro` (in flight, alone), when that step may be
    prepared and launched before `micro`'s tokens are applied; None when it may not."""
    if len(engine._in_flight) != 1 or micro.batch.prefills or micro.scorings or micro.apply is None:
        return None
    if engine.guided.active or engine._deferred_aborts or engine.executor.failure is not None:
        return None
    slots = engine.scheduler.slots
    if len(slots) != 1:
        return None
    scheduler = slots[0]
    decodes = micro.batch.decodes
    if len(scheduler.running) != len(decodes):  # a running sequence outside it (none, one slot)
        return None
    if scheduler.waiting and len(scheduler.running) < scheduler.config.max_num_seqs:
        return None  # one may be admitted now
    max_len = engine.max_model_len
    seqs = [seq for seq in decodes if not _last_by_length(seq, max_len)]
    if not seqs or len(seqs) > scheduler.config.max_num_batched_tokens:
        return None
    crossing = sum(1 for seq in seqs if len(seq.token_ids) + 1 > len(seq.block_table) * seq.block_size)
    if crossing > engine.block_manager.num_free_blocks:
        return None
    return seqs


def _last_by_length(seq: Sequence, max_model_len: int) -> bool:
    """Whether the token `seq` is about to get is its last by the length rules (`_at_length`)."""
    length = len(seq.token_ids) + 1
    return length - seq.num_prompt_tokens >= seq.max_tokens or length >= max_model_len


def prepare_ahead(runner: ModelRunner, seqs: list[Sequence], reserve) -> Prepared:  # noqa: ANN001
    """The inputs of the decode step after the one in flight: each sequence as it will be once that
    step's token is applied (one token longer, its blocks reserved for it, one more computed); the
    input ids are placeholders (`fill_tokens`)."""
    for seq in seqs:
        if len(seq.token_ids) + 1 > len(seq.block_table) * seq.block_size:
            assert reserve(seq, len(seq.token_ids) + 1), "ahead_seqs counted the free blocks"
        seq.token_ids.append(0)
        seq.num_computed_tokens += 1
    try:
        return runner.prepare(SchedulerOutput(decodes=seqs))
    finally:
        for seq in seqs:
            seq.token_ids.pop()
            seq.num_computed_tokens -= 1


def fill_tokens(prepared: Prepared, seqs: list[Sequence], result: StepResult) -> bool:
    """Write each of `seqs`'s sampled token in `result` as its input id in `prepared`; -> False (and
    nothing written) when one of them got no token (it failed)."""
    if result.seqs is seqs or result.seqs == seqs:
        tokens = result.tokens
    else:
        token_of = {seq.seq_id: token for seq, token in zip(result.seqs, result.tokens, strict=True)}
        if any(seq.seq_id not in token_of for seq in seqs):
            return False
        tokens = [token_of[seq.seq_id] for seq in seqs]
    input_ids = prepared[0]
    input_ids[: len(seqs)] = torch.tensor(tokens, dtype=input_ids.dtype).to(input_ids.device)
    return True


def live_rows(result: StepResult, apply: SchedulerOutput) -> tuple[StepResult, SchedulerOutput]:
    """A step launched ahead without the rows of sequences that finished (or were aborted) on the
    token before: computed, never applied."""
    running = SequenceStatus.RUNNING
    if all(seq.status is running for seq in apply.decodes):
        return result, apply
    keep = [i for i, seq in enumerate(result.seqs) if seq.status is running]
    live = StepResult(
        [result.seqs[i] for i in keep],
        [result.tokens[i] for i in keep],
        [result.logprobs[i] for i in keep],
        result.prompt_logprobs,
    )
    return live, SchedulerOutput([seq for seq in apply.decodes if seq.status is running])
