"""A pipeline stage's CUDA graphs, their bookkeeping run on the CPU: stage 0 captures from token ids,
a later stage from the residual stream it received, and the tokens are the eager single process's.

The capture is stood in for by a replay that re-runs the step on the static buffers (as
tests/engine/test_cuda_engine.py does for one process); the two stages run in this process, the
later one behind a loopback in place of the process group. Real CUDA: tests/pipeline/test_cuda_pipeline.py.
"""

from __future__ import annotations

import pytest

from loopback_stage import two_stages
from tessel import LLM, SamplingParams
from tessel.engine import cuda_graph, step_plan
from tessel.models.config import ModelConfig

PROMPTS = [list(range(5, 5 + 3 * i + 1)) for i in range(9)]


def _eager_record(self, step):
    hidden = step()
    return (lambda: hidden.copy_(step())), hidden


@pytest.mark.parametrize("slots", [1, 2])
def test_stage_graphs_from_ids_and_from_the_stream(tiny_dirs, tmp_path, monkeypatch, slots):
    monkeypatch.setattr(step_plan, "capture_family", lambda device: step_plan.GraphFamily.CUDA)
    monkeypatch.setattr(cuda_graph.CudaGraphDecoder, "_record", _eager_record)
    model = tiny_dirs["tied"]
    options = {"max_model_len": 128, "block_size": 8, "max_num_seqs": 16}
    engine, later = two_stages(model, tmp_path, monkeypatch, slots, **options)
    config = ModelConfig.from_dir(model)
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
