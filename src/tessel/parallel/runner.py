"""The engine's `ModelRunner` on tensor-parallel ranks.

The leader's runner is the engine's own, except that every forward (`_forward`: one process's
step, a pipeline stage's `run_stage`) is first broadcast to the followers, and its LM head sends
them the rows it projects (`VocabParallelLMHead`). So `run`, `run_stage` and `sample_hidden` are
one process's, and the collectives of every rank line up. A follower runs what the leader sends
(`follow`) and never samples.
"""

from __future__ import annotations

import torch

from tessel.engine.model_runner import ModelRunner
from tessel.models.llama import StepInputs
from tessel.parallel.group import TPGroup
from tessel.parallel.layers import VocabParallelLMHead
from tessel.parallel.step import LogitsCall, RankSetup, TPStep, broadcast, receive, with_gather


class LeaderRunner(ModelRunner):
    """Rank 0's runner: each forward goes to the followers before it runs here."""

    def __init__(
        self,
        group: TPGroup,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        pack_cpu_linears: bool,
    ) -> None:
        """Eager (the graphs hold no collectives); tells the followers the KV pool's size."""
        super().__init__(model, num_blocks, block_size, dtype, pack_cpu_linears, True, group.device)
        self.group = group
        broadcast(group, RankSetup(num_blocks, block_size, pack_cpu_linears))

    def _forward(self, step: StepInputs) -> torch.Tensor:
        broadcast(self.group, TPStep(step.positions, step.meta, step.input_ids, step.stream))
        return super()._forward(step)

    def stop_followers(self) -> None:
        broadcast(self.group, None)


def follower_runner(model: torch.nn.Module, group: TPGroup, dtype: torch.dtype) -> ModelRunner:
    """A follower's runner, its KV pool the size the leader's `RankSetup` says (eager: the graphs
    hold no collectives)."""
    setup = receive(group)
    if not isinstance(setup, RankSetup):
        raise RuntimeError(f"tensor-parallel rank {group.rank}: expected the KV setup first, got {setup!r}")
    return ModelRunner(
        model, setup.num_blocks, setup.block_size, dtype, setup.pack_cpu_linears, True, group.device
    )


@torch.inference_mode()
def follow(runner: ModelRunner, group: TPGroup) -> int:
    """Run the leader's forwards and LM head projections until it says stop -> forwards run."""
    steps = 0
    head = runner.model.lm_head
    while (message := receive(group)) is not None:
        if isinstance(message, TPStep):
            meta = with_gather(message.meta, runner.kv_cache)
            runner.run_stage(message.positions, meta, message.input_ids, message.stream)
            steps += 1
        elif isinstance(message, LogitsCall) and isinstance(head, VocabParallelLMHead):
            head.project(message.hidden)
        else:
            raise RuntimeError(f"tensor-parallel rank {group.rank}: unexpected {type(message).__name__}")
    return steps
