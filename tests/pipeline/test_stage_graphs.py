"""A pipeline stage's CUDA graphs, their bookkeeping run on the CPU: stage 0 captures from token ids,
a later stage from the residual stream it received, and the tokens are the eager single process's.

The capture is stood in for by a replay that re-runs the step on the static buffers (as
tests/engine/test_cuda_engine.py does for one process); the two stages run in this process, the
later one behind a loopback in place of the process group. Real CUDA: tests/pipeline/test_cuda_pipeline.py.
"""

from __future__ import annotations

import pickle
from collections import deque

import pytest
import torch

from pipeline_plans import write_plan
from tessel import LLM, SamplingParams
from tessel.engine import cuda_graph, step_plan
from tessel.models.config import ModelConfig
from tessel.pipeline import driver
from tessel.pipeline.comm import KvLayout, message_on
from tessel.pipeline.driver import PipelineEngine, layer_filter
from tessel.pipeline.heartbeat import Progress
from tessel.pipeline.run_plan import load_run_plan
from tessel.pipeline.stage import StageExecutor

PROMPTS = [list(range(5, 5 + 3 * i + 1)) for i in range(9)]


def _eager_record(self, step):
    hidden = step()
    return (lambda: hidden.copy_(step())), hidden


class Loopback:
    """Stage 1 run in this process where stage 0 would send to it (its message pickled as sent)."""

    def __init__(self, executor: StageExecutor) -> None:
        self.executor, self.results, self.progress = executor, deque(), Progress()

    def send_batch(self, message, hidden) -> None:
        received = pickle.loads(pickle.dumps(message_on(message, torch.device("cpu"))))
        self.executor.adopt(received)
        out = self.executor.runner.run_stage(received.positions, received.meta, stream=hidden.clone())
        self.results.append(self.executor.sample(out, received))

    def recv_tokens(self, batch_id: int, count: int):
        return self.results.popleft()

    def send_stop(self) -> None:
        pass

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("slots", [1, 2])
def test_stage_graphs_from_ids_and_from_the_stream(tiny_dirs, tmp_path, monkeypatch, slots):
    monkeypatch.setattr(step_plan, "capture_family", lambda device: step_plan.GraphFamily.CUDA)
    monkeypatch.setattr(cuda_graph.CudaGraphDecoder, "_record", _eager_record)
    monkeypatch.setattr(driver, "agree_kv_layout", lambda blocks, mine: mine)  # one stage 0 decides
    model = tiny_dirs["tied"]
    plan = load_run_plan(write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)]))
    options = {"max_model_len": 128, "block_size": 8, "max_num_seqs": 16}
    config = ModelConfig.from_dir(model)
    later = StageExecutor.load(
        model, layer_filter(plan, 1, config.tie_word_embeddings), torch.float32, "cpu", 1.0
    )
    comm = Loopback(later)
    engine = PipelineEngine(model, plan, comm, micro_batches=slots, **options)
    layout = KvLayout(engine.num_total_blocks, 8, True, 16, 128)
    later.attach_kv(layout, torch.float32, torch.device("cpu"))
    params = [
        SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))
    ]
    got = [o.token_ids for o in engine.generate(PROMPTS, params, use_progress=False)]
    want = LLM(model, enforce_eager=True, **options).generate(PROMPTS, params, use_progress=False)
    assert got == [o.token_ids for o in want]
    first, second = engine.runner.cuda_graphs, later.runner.cuda_graphs
    assert not first.takes_stream and second.takes_stream
    assert first.replays > 0 and second.replays == first.replays
    assert second.inputs.input_ids.shape == (16, config.hidden_size)
