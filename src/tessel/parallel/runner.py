"""The engine's `ModelRunner` on tensor-parallel ranks.

The leader's runner is the engine's own, except that `prepare` also broadcasts the prepared step to
the followers, so `run` (prepare, forward, sample) is one process's and the collectives of the
forward and of the LM head line up on every rank. A follower repeats the forward on its shards and
the LM head projections the leader's sampling makes (`follow_step`), and never samples.
"""

from __future__ import annotations

import torch

from tessel.engine.model_runner import ModelRunner, prompt_scorings
from tessel.engine.scheduler import SchedulerOutput
from tessel.layers.attention import AttentionMetadata
from tessel.parallel.group import TPGroup
from tessel.parallel.step import TPStep, broadcast_step, receive_step, with_gather


class LeaderRunner(ModelRunner):
    """Rank 0's runner: every prepared step goes to the followers before it runs here."""

    def __init__(self, group: TPGroup, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.group = group

    def prepare(
        self, batch: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        ids, positions, meta, sample_rows = super().prepare(batch)
        scorings = [(s.row, len(s.targets)) for _, s in prompt_scorings(batch)]
        broadcast_step(self.group, TPStep(ids, positions, meta, sample_rows, scorings))
        return ids, positions, meta, sample_rows

    def stop_followers(self) -> None:
        broadcast_step(self.group, None)


@torch.inference_mode()
def follow_step(runner: ModelRunner, step: TPStep) -> None:
    """A follower's share of the leader's step: the forward, then the LM head over the rows the
    leader projects, in its order (`ModelRunner.sample_hidden`)."""
    meta = with_gather(step.meta, runner.kv_cache)
    hidden = runner.run_stage(step.positions, meta, step.input_ids)
    model = runner.model
    for row, n in step.scoring_rows:
        model.compute_logits(hidden[row : row + n])
    rows = step.sample_rows
    if rows:
        model.compute_logits(hidden if len(rows) == hidden.shape[0] else hidden[rows])


def follow(runner: ModelRunner, group: TPGroup) -> int:
    """Run the leader's steps until it says stop -> how many ran."""
    steps = 0
    while (step := receive_step(group)) is not None:
        follow_step(runner, step)
        steps += 1
    return steps
