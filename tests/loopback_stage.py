"""Two pipeline stages in one process: stage 0's engine on a `ProcessExecutor` and stage 1's
`StageRunner` behind a loopback in place of the process group (each message through the wire
format), and stage 0 alone in this process (`pipeline_llm`)."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch

from pipeline_plans import write_plan
from tessel import LLM
from tessel.engine.emulation import SlowDevice
from tessel.models.config import ModelConfig
from tessel.pipeline import executor as executor_module
from tessel.pipeline.comm.messages import KvLayout, pack_message, unpack_message
from tessel.pipeline.executor import ProcessExecutor, layer_filter
from tessel.pipeline.options import RunOptions
from tessel.pipeline.run_plan import load_run_plan
from tessel.pipeline.stage.runner import StageRunner
from tessel.pipeline.supervision.heartbeat import StageProgress


def pipeline_llm(
    model: Path, plan: Path, *, slots: int | None = None, cutter=None, comm=None, **engine
) -> LLM:
    """An engine on `plan`'s executor with every stage of the plan in this process: a one-stage plan,
    or `comm` standing in for the others."""
    options = RunOptions(plan, model, micro_batches=slots)
    return LLM(model, executor=ProcessExecutor(options, comm=comm, cutter=cutter), **engine)


class Loopback:
    """Stage 1 run where stage 0 would send to it. `arrived`: a micro-batch's tokens count as back
    before stage 0 asks for them (a receiver thread has them), else only when it asks."""

    def __init__(self, runner: StageRunner, arrived: bool = False) -> None:
        self.runner, self.arrived = runner, arrived
        self.results, self.progress = {}, StageProgress()
        self.order: deque[int] = deque()

    def send_batch(self, message, hidden, input_ids=None) -> None:
        received = unpack_message(pack_message(message), torch.device("cpu"))
        self.runner.adopt(received)
        out = self.runner.runner.run_stage(received.positions, received.meta, stream=hidden.clone())
        self.results[message.batch_id] = self.runner.sample(out, received)

    def expect_tokens(self, batch_id: int, source: int) -> None:
        pass

    def tokens_ready(self, batch_id: int) -> bool:
        return self.arrived and batch_id in self.results

    def recv_tokens(self, batch_id: int, count: int):
        return self.results.pop(batch_id)

    def close(self) -> None:
        pass

    def abort(self, failure: BaseException) -> None:
        pass  # nothing waits on a link here

    send_stop = flush = close


def two_stages(
    model: Path,
    tmp_path: Path,
    monkeypatch,
    slots: int,
    arrived: bool = False,
    splits: tuple[tuple[int, int], ...] = ((0, 2), (2, 5)),
    **options,
):
    """(stage 0's engine, stage 1's runner) for layers `splits` (default [0, 2) and [2, 5)) of a tiny
    `model`."""
    monkeypatch.setattr(executor_module, "agree_kv_layout", lambda blocks, mine: mine)  # stage 0 decides
    plan_path = write_plan(tmp_path / "plan.json", model, list(splits))
    plan = load_run_plan(plan_path)
    config = ModelConfig.from_dir(model)
    part = layer_filter(plan, 1, config.tie_word_embeddings)
    later = StageRunner.load(model, part, torch.float32, "cpu", SlowDevice())
    loopback = Loopback(later, arrived)
    engine = pipeline_llm(model, plan_path, slots=slots, comm=loopback, **options)
    layout = KvLayout(
        engine.num_total_blocks,
        engine.config.block_size,
        engine.config.pack_cpu_linears,
        engine.config.max_num_seqs,
        engine.max_model_len,
    )
    later.attach_kv(layout, torch.float32, torch.device("cpu"))
    return engine, later
