"""Two pipeline stages in one process: stage 0's `PipelineEngine` and stage 1's `StageRunner`
behind a loopback in place of the process group (each message through the wire format)."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch

from pipeline_plans import write_plan
from tessel.models.config import ModelConfig
from tessel.pipeline import driver
from tessel.pipeline.comm import KvLayout, pack_message, unpack_message
from tessel.pipeline.driver import PipelineEngine, layer_filter
from tessel.pipeline.supervision.heartbeat import Progress
from tessel.pipeline.run_plan import load_run_plan
from tessel.pipeline.stage.runner import StageRunner


class Loopback:
    """Stage 1 run where stage 0 would send to it. `arrived`: a micro-batch's tokens count as back
    before stage 0 asks for them (a receiver thread has them), else only when it asks."""

    def __init__(self, executor: StageRunner, arrived: bool = False) -> None:
        self.executor, self.arrived = executor, arrived
        self.results, self.progress = deque(), Progress()

    def send_batch(self, message, hidden) -> None:
        received = unpack_message(pack_message(message), torch.device("cpu"))
        self.executor.adopt(received)
        out = self.executor.runner.run_stage(received.positions, received.meta, stream=hidden.clone())
        self.results.append(self.executor.sample(out, received))

    def expect_tokens(self, count: int) -> None:
        pass

    def tokens_ready(self) -> bool:
        return self.arrived and bool(self.results)

    def recv_tokens(self, batch_id: int, count: int):
        return self.results.popleft()

    def close(self) -> None:
        pass

    send_stop = flush = close


def two_stages(model: Path, tmp_path: Path, monkeypatch, slots: int, arrived: bool = False, **options):
    """(stage 0's engine, stage 1's executor) for layers [0, 2) and [2, 5) of a tiny `model`."""
    monkeypatch.setattr(driver, "agree_kv_layout", lambda blocks, mine: mine)  # one stage 0 decides
    plan = load_run_plan(write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)]))
    config = ModelConfig.from_dir(model)
    later = StageRunner.load(
        model, layer_filter(plan, 1, config.tie_word_embeddings), torch.float32, "cpu", 1.0
    )
    engine = PipelineEngine(model, plan, Loopback(later, arrived), micro_batches=slots, **options)
    layout = KvLayout(
        engine.num_total_blocks,
        engine.config.block_size,
        engine.config.pack_cpu_linears,
        engine.config.max_num_seqs,
        engine.max_model_len,
    )
    later.attach_kv(layout, torch.float32, torch.device("cpu"))
    return engine, later
