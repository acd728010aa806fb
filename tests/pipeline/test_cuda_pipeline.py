"""Pipelines with CUDA stages (needs a GPU; skipped elsewhere): two stages sharing one GPU over pinned
host buffers, and a CPU stage feeding a GPU stage, token for token against one process on the GPU
(the oracle, itself checked against HF in tests/engine/test_cuda_engine.py). CPU-side tests of the
same logic: test_devices.py, test_stage_graphs.py."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline_plans import write_plan
from tessel import LLM, SamplingParams
from tessel.errors import TesselError
from tessel.pipeline.run import RunOptions, run_pipeline

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time", "1 2 3 4"]


def gpu_plan(path, model, stages):
    """write_plan's stages, with (device, gpu_type) per stage."""
    plan = write_plan(path, model, [(a, b) for _, _, a, b in stages])
    document = json.loads(plan.read_text())
    for row, (device, kind, _, _) in zip(document["stages"], stages, strict=True):
        row["device"], row["gpu_type"] = device, kind
    plan.write_text(json.dumps(document))
    return plan


def gpu_kind() -> str:
    name = torch.cuda.get_device_name(0).upper()
    return next((k for k in ("H200", "H100", "A100", "L4", "T4", "V100") if k in name), name.split()[-1])


def reference(model, dtype, params):
    llm = LLM(model, device="cuda:0", dtype=dtype, max_model_len=256, max_num_seqs=8)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_progress=False)]


@needs_cuda
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_two_stages_on_one_gpu(tiny_dirs, tmp_path, micro_batches):
    model, kind = tiny_dirs["tied"], gpu_kind()
    plan = gpu_plan(
        tmp_path / "p.json", model, [("localhost/gpu0", kind, 0, 2), ("localhost/gpu0#2", kind, 2, 5)]
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    run = run_pipeline(
        RunOptions(plan, model, prompts=PROMPTS, max_tokens=12, ignore_eos=True, dtype="float32",
                   max_model_len=256, max_num_seqs=8, micro_batches=micro_batches, warmup=True)
    )  # fmt: skip
    assert [r["token_ids"] for r in run.requests] == reference(model, "float32", params)
    assert [s["device"] for s in run.stages] == ["cuda:0", "cuda:0"]


@needs_cuda
def test_a_cpu_stage_feeds_a_gpu_stage(tiny_dirs, tmp_path):
    model, kind = tiny_dirs["tied"], gpu_kind()
    plan = gpu_plan(
        tmp_path / "p.json", model, [("localhost-cpu/gpu0", "cpu", 0, 3), ("localhost/gpu0", kind, 3, 5)]
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    run = run_pipeline(
        RunOptions(plan, model, prompts=PROMPTS, max_tokens=12, ignore_eos=True, dtype="float32",
                   max_model_len=256, max_num_seqs=8, warmup=True)
    )  # fmt: skip
    assert [r["token_ids"] for r in run.requests] == reference(model, "float32", params)
    assert [s["device"] for s in run.stages] == ["cpu", "cuda:0"]


@needs_cuda
def test_a_gpu_this_machine_lacks_is_refused_before_start(tiny_dirs, tmp_path):
    model, kind = tiny_dirs["tied"], gpu_kind()
    missing = torch.cuda.device_count()
    plan = gpu_plan(
        tmp_path / "p.json", model, [("localhost/gpu0", kind, 0, 2), (f"localhost/gpu{missing}", kind, 2, 5)]
    )
    with pytest.raises(TesselError, match=f"runs on localhost/gpu{missing}"):
        run_pipeline(RunOptions(plan, model, prompts=PROMPTS))
    with pytest.raises(TesselError, match="cannot use NCCL"):
        shared = gpu_plan(
            tmp_path / "s.json", model, [("localhost/gpu0", kind, 0, 2), ("localhost/gpu0#2", kind, 2, 5)]
        )
        run_pipeline(RunOptions(shared, model, prompts=PROMPTS, transport="nccl"))
