"""Preemption in a pipeline (tessel.pipeline.executor): stage 0 swaps KV blocks as one process does,
the other stages repeat its copies on their layers, and the tokens are the engine's; a swapped
request moved to another executor (remap) gives back its host blocks."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from loopback_stage import pipeline_llm
from pipeline_plans import write_plan
from tessel import LLM, SamplingParams
from tessel.cli import app
from tessel.engine.executor import LocalExecutor
from tessel.errors import TesselError
from tessel.pipeline.options import RunOptions
from tessel.pipeline.supervision import launcher

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 5, "Once upon a time " * 8, "One two three"]
TIGHT = {"num_kv_blocks": 16, "block_size": 4, "max_model_len": 64}
SIXTEEN_TOKEN_BLOCK_BYTES = 2 * 5 * 16 * 2 * 16 * 4  # k and v, 5 layers, 16 tokens, 2 KV heads of 16, fp32


def test_a_one_stage_plan_swaps_and_matches_the_engine(tiny_dirs, tmp_path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plan = write_plan(tmp_path / "plan.json", tiny_dirs["tied"], [(0, 5)])
    engine = pipeline_llm(tiny_dirs["tied"], plan, slots=2, preemption_mode="swap", **TIGHT)
    got = [out.token_ids for out in engine.generate([p[:60] for p in PROMPTS], params, use_progress=False)]
    stats = engine.preemption_stats
    assert stats.swaps > 0 and stats.recomputes == 0 and stats.bytes_to_device == stats.bytes_to_host
    llm = LLM(tiny_dirs["tied"], preemption_mode="recompute", max_model_len=64)
    assert got == [o.token_ids for o in llm.generate([p[:60] for p in PROMPTS], params, use_progress=False)]
    assert engine.num_free_blocks == engine.num_total_blocks


def test_launch_passes_the_options_to_the_workers(tiny_dirs, tmp_path) -> None:
    plan = write_plan(tmp_path / "plan2.json", tiny_dirs["tied"], [(0, 2), (2, 5)])
    given = RunOptions(plan, tiny_dirs["tied"], emulate_host_gbps=8.0, host_kv_cache_gib=0.5)
    read = RunOptions.read(given.write(tmp_path / "options.json"))  # what the workers read
    assert read == given
    kwargs = read.engine_kwargs()
    assert kwargs["preemption_mode"] == "auto"  # what the workers' engine gets
    assert kwargs["emulate_host_gbps"] == 8.0 and kwargs["host_kv_cache_gib"] == 0.5


def test_a_swapped_request_moves_to_another_executor_and_is_recomputed_there(tiny_dirs) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [p[:60] for p in PROMPTS]
    expected = LLM(tiny_dirs["tied"], max_model_len=64).generate(prompts, params, use_progress=False)
    engine = LLM(tiny_dirs["tied"], preemption_mode="swap", **TIGHT)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while not any(seq.host_blocks for seq in engine.scheduler.waiting):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    old_pool = engine.preemptor.pool
    executor = LocalExecutor()
    moved = engine.replace_executor(executor, executor.start(engine.setup_for(executor)))
    assert moved and set(moved) <= set(tokens) and engine.executor is executor
    assert old_pool.num_free_blocks == old_pool.num_total_blocks
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == [o.token_ids for o in expected]


def test_two_stages_swap_and_match_the_engine(tiny_dirs, tmp_path) -> None:
    """Two worker processes: stage 0 swaps, stage 1 repeats its copies on its own layers' KV (a
    lost copy there would change the tokens), and stage 0's status counts the swaps."""
    from tessel.pipeline.run import run_pipeline

    plan = write_plan(tmp_path / "plan.json", tiny_dirs["tied"], [(0, 2), (2, 5)])
    prompts = [p[:60] for p in PROMPTS]
    options = RunOptions(plan, tiny_dirs["tied"], prompts=prompts, max_tokens=24, ignore_eos=True,
                         preemption_mode="swap", kv_cache_gib=6 * SIXTEEN_TOKEN_BLOCK_BYTES / 2**30,
                         max_model_len=64, run_dir=tmp_path / "run")  # fmt: skip
    run = run_pipeline(options)
    status = run.stages[0]
    assert status["kv_swaps"] > 0 and status["kv_recomputes"] == 0 and status["kv_swap_bytes"] > 0
    llm = LLM(tiny_dirs["tied"], preemption_mode="recompute", max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert [r["token_ids"] for r in run.requests] == [
        o.token_ids for o in llm.generate(prompts, params, use_progress=False)
    ]


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--emulate-host-gbps", "1e-12", "1e-12 is below 0.001"),  # issue 42, item 2: swaps waited years
        ("--kv-cache-gib", "0", "0 is below 1e-06"),  # issue 42, item 8: refused after every stage started
        ("--kv-cache-gib", "nan", "NaN is not a number"),
    ],
)
def test_launch_refuses_an_unbounded_preemption_before_any_stage_starts(
    tiny_dirs, tmp_path, monkeypatch, option, value, said
) -> None:
    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a stage process started")

    monkeypatch.setattr(launcher, "spawn_worker", refuse)
    plan = write_plan(tmp_path / "plan.json", tiny_dirs["tied"], [(0, 2), (2, 5)])
    args = ["launch", "--plan", str(plan), "--model", str(tiny_dirs["tied"]), "--ignore-eos"]
    args += [arg for prompt in PROMPTS * 3 for arg in ("--prompt", prompt)][:16]  # eight prompts
    args += ["--kv-cache-gib", "0.0004", "--preemption-mode", "swap", option, value]
    result = CliRunner().invoke(app, args)
    message = " ".join(result.output.replace("\u2502", " ").split())
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), repr(result.exception)
    assert f"'{option}': {said}" in message


def test_run_options_refuse_an_unbounded_preemption_before_any_stage_starts(tiny_dirs, tmp_path, monkeypatch):
    """The Python API (`run_pipeline`) refuses what the CLI does, with the same floors."""
    from tessel.pipeline.run import run_pipeline

    monkeypatch.setattr(launcher, "spawn_worker", lambda *a, **k: pytest.fail("a stage process started"))
    plan = write_plan(tmp_path / "plan.json", tiny_dirs["tied"], [(0, 5)])
    for field, value in (
        ("emulate_host_gbps", 1e-12),
        ("kv_cache_gib", 0.0),
        ("host_kv_cache_gib", float("nan")),
    ):
        options = RunOptions(plan, tiny_dirs["tied"], prompts=["x"], preemption_mode="swap", **{field: value})
        with pytest.raises(TesselError, match=field):
            run_pipeline(options)
