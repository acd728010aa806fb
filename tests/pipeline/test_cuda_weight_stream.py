"""Streamed weights on a CUDA GPU (needs one; skipped elsewhere): half the layers of a stage in
pinned host memory, copied on a side stream into two device buffers, token for token against the
eager engine on the same GPU holding every layer (the oracle, itself checked against HF in
tests/engine/test_cuda_engine.py). The schedule, buffer rotation and sizes are checked on the CPU in
test_weight_stream.py."""

from __future__ import annotations

import json

import pytest
import torch

from loopback_stage import pipeline_llm
from pipeline_plans import write_plan
from tessel import LLM, SamplingParams
from tessel.engine.weight_stream import CudaMover, layer_weight_bytes
from tessel.models.config import ModelConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time", "1 2 3 4"]


def gpu_kind() -> str:
    name = torch.cuda.get_device_name(0).upper()
    return next((k for k in ("H200", "H100", "A100", "L4", "T4", "V100") if k in name), name.split()[-1])


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_half_the_layers_streamed_on_cuda_give_the_resident_tokens(tiny_dirs, tmp_path, dtype):
    model = tiny_dirs["untied"]
    plan = write_plan(tmp_path / "p.json", model, [(0, 6)], micro_batches=1)
    document = json.loads(plan.read_text())
    document["stages"][0].update(device="localhost/gpu0", gpu_type=gpu_kind(), offload_layers=[3, 4, 5])
    plan.write_text(json.dumps(document))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    resident = LLM(model, device="cuda:0", dtype=dtype, enforce_eager=True, max_model_len=256)
    expected = [o.token_ids for o in resident.generate(PROMPTS, params, use_progress=False)]
    engine = pipeline_llm(model, plan, dtype=dtype, max_model_len=256)
    got = [o.token_ids for o in engine.generate(PROMPTS, params, use_progress=False)]
    assert got == expected
    streamer, stats = engine.executor.stage.streamer, engine.executor.stage.stats
    assert isinstance(streamer.mover, CudaMover)
    for index, layer in streamer.layers.items():
        assert all(t.host.is_pinned() and t.host.device.type == "cpu" for t in layer.tensors)
        weights = list(engine.model.model.layers[index].parameters())
        assert all(w.device.type == "cuda" for w in weights)
    per_layer = layer_weight_bytes(ModelConfig.from_dir(model), getattr(torch, dtype))
    assert stats.stream_copies == 3 + 2 * (stats.batches - 1)  # layer 4 stays in its buffer
    assert stats.stream_copy_bytes == stats.stream_copies * per_layer
    assert stats.stream_copy_s > 0 and 0 <= stats.stream_hidden_s <= stats.stream_copy_s
    assert stats.stream_emulated_s == 0  # a real link: nothing emulated
    streamer.close()
