"""Tensor-parallel stages inside a pipeline: TP=2 x 2 stages (stage 0's engine on a `ProcessExecutor`
and stage 1's runner over the tests' loopback, each stage the leader of its own follower process)
give one process's greedy tokens, and the prompt logprobs the last stage scores; a version-5 plan
file (`tp_degree`, `gpus`, `tp_link` per stage, the planner's format) runs through `run_pipeline`'s
real stage processes with the same tokens; the plan's TP stages are refused before any process
starts by the planner's checks (`check_tp_stages`) and the runtime's own.

The loopback tests give the stages their degree on the `RunPlan` the executor reads."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys

import pytest
import torch

import tiny_models
from loopback_stage import Loopback, pipeline_llm
from pipeline_plans import write_plan
from stage_processes import release
from tessel import LLM, SamplingParams, TesselError
from tessel.engine.emulation import SlowDevice
from tessel.models.config import ModelConfig
from tessel.pipeline import executor as executor_module
from tessel.pipeline.checks import check_options, check_tensor_parallel_stages
from tessel.pipeline.comm.messages import KvLayout
from tessel.pipeline.executor import layer_filter
from tessel.pipeline.run import RunOptions, describe_links, run_pipeline
from tessel.pipeline.run_plan import load_run_plan
from tessel.pipeline.stage.runner import StageRunner
from tessel.pipeline.supervision.supervisor import Supervisor

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


@pytest.mark.slow
def test_plan_file_tp_stage_runs_in_stage_processes(checkpoints, tmp_path) -> None:
    """A version-5 plan on CPUs, stage 1 over two (`gpus`: localhost/cpu1, localhost/cpu2): `tessel
    launch`'s path spawns the stage processes, stage 1's process leads its follower, and the greedy
    tokens are one process's."""
    model = checkpoints("llama")
    plan = write_plan(tmp_path / "plan.json", model, [(0, 1), (1, 2)], degrees=[1, 2])
    prompts = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3]
    options = RunOptions(
        plan, model, prompts=prompts, max_tokens=12, ignore_eos=True, run_dir=tmp_path / "run"
    )
    assert describe_links(options) == ["stage 0 (cpu) -> stage 1 (cpu, TP 2): gloo, host memory"]
    run = run_pipeline(options)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLM(str(model)).generate(prompts, params, use_progress=False)
    assert [r["token_ids"] for r in run.requests] == [o.token_ids for o in want]
    assert [(s["state"], s["tp_degree"]) for s in run.stages] == [("done", 1), ("done", 2)]
    assert (tmp_path / "run" / "stage1.rank1.log").exists()


def _edit_plan(path, edit):  # noqa: ANN001, ANN202
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))
    return path


def test_plan_file_tp_gpus(checkpoints, tmp_path) -> None:
    """A CPU stage's `gpus` name CPU devices: its ranks get no CUDA index; a GPU stage's ranks are
    read from `<node>/gpu<K>` (the `#2` of a shared GPU too); a rank naming no index is refused."""
    model = checkpoints("llama")
    plan = load_run_plan(write_plan(tmp_path / "cpu.json", model, [(0, 1), (1, 2)], degrees=[1, 2]))
    assert [(s.tp_degree, s.tp_gpus) for s in plan.stages] == [(1, None), (2, None)]

    def on_gpus(names):  # noqa: ANN001, ANN202
        def edit(document):  # noqa: ANN001, ANN202
            for stage, device in zip(document["stages"], ["n/gpu0", names[0]], strict=True):
                stage.update(device=device, gpu_type="H100")
            document["stages"][0]["gpus"] = ["n/gpu0"]
            document["stages"][1]["gpus"] = names

        return edit

    path = write_plan(tmp_path / "gpu.json", model, [(0, 1), (1, 2)], degrees=[1, 2])
    plan = load_run_plan(_edit_plan(path, on_gpus(["n/gpu2", "n/gpu3#2"])))
    assert [s.tp_gpus for s in plan.stages] == [None, (2, 3)]
    with pytest.raises(
        TesselError, match=r"stage 1 \(n/gpu2\): gpus names 'n/fast', which names no GPU index"
    ):
        load_run_plan(_edit_plan(path, on_gpus(["n/gpu2", "n/fast"])))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"tp_degree": 3, "gpus": ["localhost/cpu1", "localhost/cpu2", "localhost/cpu3"]},
            r"stages\[1\] \(localhost/cpu1\): tp_degree 3 is not one of 1, 2, 4, 8",
        ),
        (
            {"gpus": ["localhost/cpu1"]},
            r"stages\[1\] \(localhost/cpu1\): tp_degree 2 but 1 gpus listed",
        ),
        (
            {"gpus": ["localhost/cpu2", "localhost/cpu1"]},
            r"stages\[1\] \(localhost/cpu1\): gpus\[0\] is 'localhost/cpu2', not the stage's device",
        ),
        (
            {"gpus": ["localhost/cpu1", "localhost/cpu0"]},
            r"GPU 'localhost/cpu0' is named twice: stages\[0\] \(localhost/cpu0\) rank 0 and stages\[1\]",
        ),
    ],
)
def test_plan_file_tp_stage_structure_refused(checkpoints, tmp_path, fields, message) -> None:
    """The planner's structural checks, as the runtime reads the plan (`load_run_plan`)."""
    path = write_plan(tmp_path / "plan.json", checkpoints("llama"), [(0, 1), (1, 2)], degrees=[1, 2])
    with pytest.raises(TesselError, match=message):
        load_run_plan(_edit_plan(path, lambda d: d["stages"][1].update(fields)))


def _check(plan_path, model, cpp=True):  # noqa: ANN001, ANN202
    """What `tessel launch` checks before it starts any process."""
    return check_options(RunOptions(plan_path, model, prompts=["Hello world"], max_tokens=4, cpp=cpp))


def test_plan_file_tp_stages_get_the_planners_checks(checkpoints, tmp_path) -> None:
    """A plan file's TP stage is held to the planner's rule (the degree divides the checkpoint's heads
    and KV heads), where the engine's --tensor-parallel-size splits 3 KV heads 2 + 1; the messages
    name the stage and the numbers. What only the runtime knows is refused too."""
    model = checkpoints("llama")  # 4 heads over 2 KV heads
    path = write_plan(tmp_path / "plan.json", model, [(0, 1), (1, 2)], degrees=[1, 2])
    _check(path, model)
    # the checkpoint's heads, not the plan's copy of its config: a plan made for 2 KV heads, run on 3
    odd = tiny_models.make_tiny_checkpoint(
        tmp_path / model.name, num_kv_heads=3, num_attention_heads=6, hidden_size=96
    )
    with pytest.raises(
        TesselError, match=r"stages\[1\] \(localhost/cpu1\): degree 2 does not divide the 3 KV heads"
    ):
        _check(path, odd)
    # the plan's own config says 3 KV heads: refused as the plan is read
    three = write_plan(tmp_path / "three.json", odd, [(0, 1), (1, 2)], degrees=[1, 2])
    with pytest.raises(
        TesselError, match=r"stages\[1\] \(localhost/cpu1\): degree 2 does not divide the 3 KV heads"
    ):
        load_run_plan(three)
    # the engine's flag splits the same model unevenly (the runtime's rule alone)
    from tessel.parallel.executor import check_tensor_parallel

    assert check_tensor_parallel(ModelConfig.from_dir(odd), 2, "cpu", None) is not None
    # the runtime's own: no ring link to price the CPP chunks with (fine without CPP), streamed layers
    unlinked = _edit_plan(path, lambda d: d["stages"][1].update(tp_link=None))
    with pytest.raises(
        TesselError, match=r"stage 1 \(localhost/cpu1\): tp_degree 2 without `tp_link`.*--no-cpp"
    ):
        _check(unlinked, model)
    _check(unlinked, model, cpp=False)
    streamed = _edit_plan(path, lambda d: d["stages"][1].update(offload_layers=[1]))
    with pytest.raises(
        TesselError, match=r"stage 1: layers streamed from host memory \(offload_layers \[1\]\)"
    ):
        _check(streamed, model)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the follower through /proc")
def test_lost_tp_stage_is_named_and_rebuilt(checkpoints, tmp_path) -> None:
    """`tessel serve --plan`'s supervisor: a SIGKILLed follower of the TP stage 1 fails that stage,
    the supervisor names the stage, rebuilds the pipeline on stage 0's device alone, and the next
    request gets the tokens of before."""
    model = checkpoints("llama")
    plan = write_plan(tmp_path / "plan.json", model, [(0, 1), (1, 2)], degrees=[1, 2])
    engine = Supervisor.serve(RunOptions(plan, model, heartbeat_timeout=30.0), max_rebuilds=1)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    stage1 = engine.executor.stages.procs[0].pid
    followers = _children(stage1)
    try:
        before = engine.generate(["Hello world"], params, use_progress=False)[0].token_ids
        assert len(followers) == 1
        for pid in followers:
            os.kill(pid, signal.SIGKILL)
        after = engine.generate(["Hello world"], params, use_progress=False)[0].token_ids
        assert after == before
        assert engine.supervisor.num_rebuilds == 1
        assert "pipeline stage 1 failed" in engine.supervisor.last_recovery.reason
        assert [s.tp_degree for s in engine.executor.plan.stages] == [1]
    finally:
        engine.supervisor.close()
        release([stage1, *followers])


def _children(pid: int) -> set[int]:
    children: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as listed:
            children.update(int(child) for child in listed.read().split())
    return children
