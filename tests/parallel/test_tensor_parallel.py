"""The engine split over tensor-parallel ranks (real follower processes over gloo) against one
process: greedy tokens equal for Llama (GQA, untied; tied with llama3 rope scaling) and Qwen3 (q/k
norms), seeded sampling and logprobs too; degrees that cannot split, and GPU ranks this machine
cannot hold, refused before any process starts; a killed follower stops the engine with an error
naming it, never a hang."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from tessel import LLM, SamplingParams, TesselError
from tessel.parallel.executor import TensorParallelExecutor
from tessel.parallel.group import RankLostError, check_gpus, rank_device, tp_backend

PROMPTS = [[1, 5, 9, 33, 70], [2, 100, 200, 7, 8, 9, 10], list(range(3, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _tokens(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def _pair(path, **kwargs):  # noqa: ANN001, ANN202
    one = LLM(str(path), num_kv_blocks=64, **kwargs)
    tp = LLM(str(path), num_kv_blocks=64, tensor_parallel_size=2, **kwargs)
    return one, tp


def test_tp2_llama_greedy_equals_one_process(checkpoints) -> None:
    one, tp = _pair(checkpoints("llama"))
    try:
        assert _tokens(tp, GREEDY) == _tokens(one, GREEDY)
    finally:
        tp.shutdown()
    assert all(proc.poll() == 0 for proc in tp.executor.procs)  # stopped when told, no error


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "llama31_tied"])
def test_tp2_greedy_equals_one_process(checkpoints, name: str) -> None:
    one, tp = _pair(checkpoints(name))
    try:
        assert _tokens(tp, GREEDY) == _tokens(one, GREEDY)
    finally:
        tp.shutdown()


@pytest.mark.slow
def test_tp2_seeded_sampling_and_logprobs_equal_one_process(checkpoints) -> None:
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=16, ignore_eos=True),
    ]
    one, tp = _pair(checkpoints("qwen3"))
    try:
        want, got = one.generate(PROMPTS, params), tp.generate(PROMPTS, params)
    finally:
        tp.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        for name in ("logprobs", "prompt_logprobs"):
            gl, wl = getattr(g, name), getattr(w, name)
            assert (gl is None) == (wl is None)
            for a, b in zip(gl or [], wl or [], strict=True):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_a_degree_above_the_kv_heads_is_refused_before_any_process(checkpoints) -> None:
    executor = TensorParallelExecutor(3)
    with pytest.raises(TesselError, match=r"degree 3 exceeds the model's 2 KV heads \(4 attention heads\)"):
        LLM(str(checkpoints("llama")), executor=executor)
    assert executor.procs == []


def test_gpu_ranks_are_checked_before_any_process() -> None:
    with pytest.raises(TesselError, match="degree 4 needs 4 GPUs, this machine has 1"):
        check_gpus([0, 1, 2, 3], 4, visible=1, where="stage 1")
    with pytest.raises(TesselError, match="stage 0: the tensor-parallel ranks name GPU 1 twice"):
        check_gpus([1, 1], 2, visible=2, where="stage 0")
    with pytest.raises(TesselError, match="GPU 5 does not exist"):
        check_gpus([0, 5], 2, visible=2)
    check_gpus([1, 0], 2, visible=2)


def test_cuda_ranks_take_nccl_and_a_gpu_each() -> None:
    """The NCCL path's set-up, checked on the CPU: the backend and each rank's device."""
    assert tp_backend(torch.device("cuda", 1)) == "nccl"
    assert tp_backend(torch.device("cpu")) == "gloo"
    assert [rank_device("cuda", [2, 0], r) for r in (0, 1)] == [
        torch.device("cuda", 2),
        torch.device("cuda", 0),
    ]
    assert rank_device("cuda", None, 1) == torch.device("cuda", 1)
    assert rank_device("cpu", None, 1) == torch.device("cpu")


@pytest.mark.slow
def test_a_killed_follower_stops_the_engine_with_its_name(checkpoints) -> None:
    tp = LLM(str(checkpoints("llama")), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        tp.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2))
        follower = tp.executor.procs[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.wait()
        # the watcher saw the exit, or the step's first collective fails and waits for its name
        with pytest.raises(RankLostError, match=r"rank 1 \(pid \d+\) killed by signal SIGKILL"):
            tp.generate(PROMPTS, GREEDY)
        with pytest.raises(RankLostError):  # and the engine stays stopped
            tp.generate(PROMPTS, GREEDY)
    finally:
        tp.shutdown()


def test_a_stopped_follower_stops_the_engine_with_its_name(checkpoints, monkeypatch) -> None:  # noqa: ANN001
    """SIGSTOP, not a death: the leader waits in the step's broadcast (gloo), the watcher sees the
    follower stopped through the whole limit, names it and kills it, and the step raises that."""
    from tessel.parallel import shm

    monkeypatch.setattr(shm, "STOPPED_LIMIT_S", 0.5)
    tp = LLM(str(checkpoints("llama")), num_kv_blocks=64, tensor_parallel_size=2)
    follower = None
    try:
        tp.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2))
        follower = tp.executor.procs[0]
        os.kill(follower.pid, signal.SIGSTOP)
        with pytest.raises(Exception, match=rf"rank 1 \(pid {follower.pid}\) has been stopped for"):
            tp.generate(PROMPTS, GREEDY)
    finally:
        if follower is not None and follower.poll() is None:  # the watcher killed it: nothing to resume
            os.kill(follower.pid, signal.SIGCONT)
        tp.shutdown()


def test_the_cli_refuses_a_degree_the_model_cannot_split(checkpoints) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tessel.cli",
            "generate",
            "--model",
            str(checkpoints("llama")),
            "--prompt",
            "hi",
        ]
        + ["--tensor-parallel-size", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "degree 4 exceeds the model's 2 KV heads" in " ".join(done.stderr.split())


@pytest.mark.slow
def test_tp2_over_three_kv_heads_splits_unevenly_and_equals_one_process(tmp_path) -> None:
    """SmolLM2's shape of heads (3 KV heads, 3 query heads each) over 2 ranks: 2 + 1 KV heads."""
    import tiny_models

    path = tiny_models.make_tiny_checkpoint(
        tmp_path / "uneven",
        num_kv_heads=3,
        num_attention_heads=6,
        hidden_size=96,
        intermediate_size=160,
        seed=12,
    )
    one, tp = _pair(path)
    try:
        assert [s.num_kv_heads for s in _split(path).shards] == [2, 1]
        assert _tokens(tp, GREEDY) == _tokens(one, GREEDY)
    finally:
        tp.shutdown()


def _split(path):  # noqa: ANN001, ANN202
    from tessel.models.config import ModelConfig
    from tessel.parallel.split import TPSplit

    return TPSplit.of(ModelConfig.from_dir(path), 2)
