"""Tensor-parallel stages inside a pipeline: TP=2 x 2 stages (stage 0's engine on a `ProcessExecutor`
and stage 1's runner over the tests' loopback, each stage the leader of its own follower process)
give one process's greedy tokens, and the prompt logprobs the last stage scores.

The plan file's `tp_degree` per stage is the planner's format (not on this branch yet): the test
gives the stages their degree on the `RunPlan` the executor reads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loopback_stage import Loopback, pipeline_llm
from pipeline_plans import write_plan
from tessel import LLM, SamplingParams
from tessel.engine.emulation import SlowDevice
from tessel.models.config import ModelConfig
from tessel.pipeline import executor as executor_module
from tessel.pipeline.comm.messages import KvLayout
from tessel.pipeline.executor import layer_filter
from tessel.pipeline.run_plan import load_run_plan
from tessel.pipeline.stage.runner import StageRunner

PROMPTS = [[1, 5, 9, 33, 70], [2, 100, 200, 7, 8, 9, 10], list(range(3, 40))]


def _tp_plan(path, replica=None):  # noqa: ANN001, ANN202
    plan = load_run_plan(path, replica)
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, tp_degree=2) for s in plan.stages))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3", "llama31_tied"])
def test_tp2_by_two_stages_equals_one_process(checkpoints, tmp_path, monkeypatch, name: str) -> None:
    model = checkpoints(name)
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    ]
    want = LLM(str(model), num_kv_blocks=64).generate(PROMPTS, params)
    monkeypatch.setattr(executor_module, "agree_kv_layout", lambda blocks, mine: mine)  # stage 0 decides
    monkeypatch.setattr(executor_module, "load_run_plan", _tp_plan)
    plan_path = write_plan(tmp_path / "plan.json", model, [(0, 1), (1, 2)])
    plan = _tp_plan(plan_path)
    part = layer_filter(plan, 1, ModelConfig.from_dir(model).tie_word_embeddings)
    later = StageRunner.load(
        model, part, torch.float32, "cpu", SlowDevice(), tp_degree=2, rank=1, run_dir=tmp_path
    )
    engine = pipeline_llm(model, plan_path, slots=1, comm=Loopback(later), num_kv_blocks=64)
    try:
        c = engine.config
        later.attach_kv(
            KvLayout(
                engine.num_total_blocks,
                c.block_size,
                c.pack_cpu_linears,
                c.max_num_seqs,
                engine.max_model_len,
            ),
            torch.float32,
            torch.device("cpu"),
        )
        got = engine.generate(PROMPTS, params)
    finally:
        engine.shutdown()
        later.stop_tp()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got[1].prompt_logprobs[1:], want[1].prompt_logprobs[1:], strict=True):
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-4)
    assert len(engine.executor.stage.tp.ranks.procs) == 1 and len(later.tp.ranks.procs) == 1
    assert all(p.poll() == 0 for p in [*engine.executor.stage.tp.ranks.procs, *later.tp.ranks.procs])


def _plan_with(path, degrees, gpus=None, gpu_type="cpu"):  # noqa: ANN001, ANN202
    plan = load_run_plan(path)
    stages = tuple(
        dataclasses.replace(s, tp_degree=d, tp_gpus=None if gpus is None else gpus[i], gpu_type=gpu_type)
        for i, (s, d) in enumerate(zip(plan.stages, degrees, strict=True))
    )
    return dataclasses.replace(plan, stages=stages)


def test_tp_stages_are_checked_before_any_process(checkpoints, tmp_path, monkeypatch) -> None:
    from tessel import TesselError
    from tessel.pipeline.checks import check_tensor_parallel_stages

    model = checkpoints("llama")  # 4 heads over 2 KV heads
    config = ModelConfig.from_dir(model)
    plan_path = write_plan(tmp_path / "plan.json", model, [(0, 1), (1, 2)])
    check_tensor_parallel_stages(_plan_with(plan_path, [2, 2]), config)
    with pytest.raises(
        TesselError, match=r"stage 1: tensor-parallel degree 3 exceeds the model's 2 KV heads"
    ):
        check_tensor_parallel_stages(_plan_with(plan_path, [1, 3]), config)
    streamed = _plan_with(plan_path, [1, 2])
    streamed = dataclasses.replace(
        streamed, stages=(streamed.stages[0], dataclasses.replace(streamed.stages[1], offload_layers=(1,)))
    )
    with pytest.raises(
        TesselError, match=r"stage 1: layers streamed from host memory \(offload_layers \[1\]\)"
    ):
        check_tensor_parallel_stages(streamed, config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(TesselError, match="stage 0: the tensor-parallel ranks name GPU 0 twice"):
        check_tensor_parallel_stages(_plan_with(plan_path, [2, 1], [(0, 0), None], "H100"), config)
    with pytest.raises(TesselError, match="stage 1: GPU 1 is already a tensor-parallel rank of stage 0"):
        check_tensor_parallel_stages(_plan_with(plan_path, [2, 2], [(0, 1), (1, 0)], "H100"), config)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(
        TesselError, match="stage 0: tensor-parallel degree 2 needs 2 GPUs, this machine has 1"
    ):
        check_tensor_parallel_stages(_plan_with(plan_path, [2, 1], None, "H100"), config)


def _int8_plan(path, model, splits):  # noqa: ANN001, ANN202
    import json

    write_plan(path, model, splits)
    plan = json.loads(path.read_text())
    plan.update(version=2, granularity="layer", precisions=["int8"])
    for stage in plan["stages"]:
        layers = stage["layer_end"] - stage["layer_start"]
        stage.update(
            unit_start=stage["layer_start"], unit_end=stage["layer_end"], precisions=["int8"] * layers
        )
    path.write_text(json.dumps(plan))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_tp2_w8a8_equals_one_process_w8a8(checkpoints, tmp_path, monkeypatch, name: str) -> None:
    """Every layer W8A8 (the plan's int8, rounded at load): TP=2 rounds weights and activations as
    one process does (row-parallel layers by the whole row's maxima), so the tokens are the same."""
    model = checkpoints(name)
    plan_path = _int8_plan(tmp_path / "plan.json", model, [(0, 2)])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one = pipeline_llm(model, plan_path, slots=1, num_kv_blocks=64)
    try:
        want = [o.token_ids for o in one.generate(PROMPTS, params)]
        assert "W8A8Linear" in repr(one.executor.model)
    finally:
        one.shutdown()
    monkeypatch.setattr(executor_module, "load_run_plan", _tp_plan)
    tp = pipeline_llm(model, plan_path, slots=1, num_kv_blocks=64)
    try:
        got = [o.token_ids for o in tp.generate(PROMPTS, params)]
        assert "RowMaxInput" in repr(tp.executor.model)
    finally:
        tp.shutdown()
    assert got == want
