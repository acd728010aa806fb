"""Changing a serving pipeline's split: moving requests from one engine into another.

The plan on the surviving stages (`survivor_plan`, `write_survivor_plan`, `SurvivorsTooSmallError`)
is planned on the planner side, `tessel.plan.remap.survivors`.

`migrate_requests(old, new)` moves every unfinished request of one engine into another, between
two steps: each request's `Sequence` keeps its prompt, the tokens generated so far, its sampling
parameters, its remaining `max_tokens`, its stop rules and detokenizer, its logprobs so far and its
metrics; its KV is not copied but rebuilt in the new pipeline by recomputation (the engine's
preemption path: `num_computed_tokens = 0`, then prompt + output are prefilled again and the last
position's logits give the next token). A seeded sampled request's generator lives on the last
stage (`tessel.pipeline.stage`): the new last stage fast-forwards a fresh one past the noise draws
its tokens so far consumed (`resume_draws`), so seeded outputs continue as an undisturbed run would.
Outputs keep flowing to the same request ids, so a server's streams continue.
"""

from __future__ import annotations

from typing import Any

from tessel.errors import TesselError


class RemapFailedError(TesselError):
    """A remap failed before or during the switch; the message says what and that it rolled back."""


# ---- moving requests -----------------------------------------------------------------------------
def migrate_requests(old: Any, new: Any) -> list[str]:
    """Move every unfinished request of engine `old` into engine `new` (both `LLMEngine`s, neither
    stepping), in arrival order, to be recomputed there; -> the request ids moved. Requests aborted
    while their micro-batch was in flight (`PipelineEngine`'s deferred aborts) are dropped."""
    deferred = getattr(old, "_deferred_aborts", set())
    resume = getattr(new, "resume_draws", None)
    moved = []
    for request_id, seq in list(old._requests.items()):
        if seq.is_finished or request_id in deferred:
            continue
        if request_id in new._requests:
            raise TesselError(f"request id {request_id!r} is already in the new engine")
        _forget(old, seq)
        _reset(seq, new.config.block_size)
        new._requests[request_id] = seq
        new._detokenizers[request_id] = old._detokenizers.pop(request_id)
        new._emitted[request_id] = old._emitted.pop(request_id)
        del old._requests[request_id]
        new.scheduler.add(seq)
        if resume is not None and seq.params.seed is not None and seq.params.temperature > 0:
            resume[seq.seq_id] = seq.num_output_tokens  # one noise draw per sampled token
        moved.append(request_id)
    return moved


def _forget(engine: Any, seq: Any) -> None:
    """Take `seq` out of `engine`'s scheduler (one, or a pipeline's per-slot ones) and free its
    blocks there, without finishing it."""
    scheduler = engine.scheduler
    slots = getattr(scheduler, "slots", None)
    if slots is not None:
        scheduler._slot_of.pop(seq.seq_id, None)
    for queue_owner in slots or [scheduler]:
        for queue in (queue_owner.running, queue_owner.waiting):
            if seq in queue:
                queue.remove(seq)
    preemptor = getattr(engine, "preemptor", None)
    if preemptor is not None and getattr(seq, "host_blocks", None):
        preemptor.release(seq)  # swapped out: its KV in the old engine's host pool is dropped too
    engine.block_manager.free(seq)
    preemptor = getattr(engine, "preemptor", None)
    if preemptor is not None:  # a swapped-out request: its KV in the old engine's host pool
        preemptor.release(seq)


def _reset(seq: Any, block_size: int) -> None:
    """The sequence as a preempted one: no KV anywhere, everything to compute again."""
    from tessel.engine.sequence import SequenceStatus

    seq.num_computed_tokens = 0
    seq.host_blocks = []  # nothing swapped out in the new engine's host pool
    seq.block_table = []
    seq.host_blocks = []
    seq.block_keys = []
    seq.num_registered_blocks = 0
    seq.block_size = block_size
    seq.status = SequenceStatus.WAITING


__all__ = ["RemapFailedError", "migrate_requests"]
