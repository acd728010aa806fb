"""`tessel launch` end to end: real stage processes over gloo, outputs token for token equal to the
single-process engine (`LLM`, the oracle), for 2 and 3 stages, uneven splits and CPP prefill."""

from __future__ import annotations

import json

from pipeline_plans import write_plan
from tessel import LLM, SamplingParams
from tessel.errors import TesselError
from tessel.pipeline.run import RunOptions, run_pipeline

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Once upon a time there was a small model",
    "Paged attention stores keys and values in blocks. " * 2,
]


def reference(model_dir, prompts, params: list[SamplingParams]) -> list[list[int]]:
    llm = LLM(model_dir)
    return [out.token_ids for out in llm.generate(prompts, params, use_progress=False)]


def test_two_uneven_stages_tied_embeddings(tiny_dirs, tmp_path):
    """Stage 0 holds 1 layer + the embedding, stage 1 holds 4 layers + the tied head; 3 slots;
    greedy and seeded sampling requests from a prompts file."""
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 1), (1, 5)], micro_batches=3)
    lines = [{"prompt": p, "max_tokens": 10 + i} for i, p in enumerate(PROMPTS)]
    lines.append({"prompt": PROMPTS[1], "temperature": 0.8, "top_k": 30, "seed": 5, "max_tokens": 9})
    prompts_file = tmp_path / "requests.jsonl"
    prompts_file.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    run = run_pipeline(RunOptions(plan, model, prompts_file=prompts_file, ignore_eos=True, warmup=True))
    params = [
        SamplingParams(temperature=0.0, max_tokens=10 + i, ignore_eos=True) for i in range(len(PROMPTS))
    ]
    params.append(SamplingParams(temperature=0.8, top_k=30, seed=5, max_tokens=9, ignore_eos=True))
    expected = reference(model, [line["prompt"] for line in lines], params)
    assert [r["token_ids"] for r in run.requests] == expected
    assert [s["state"] for s in run.stages] == ["done", "done"]
    assert [(s["layer_start"], s["layer_end"]) for s in run.stages] == [(0, 1), (1, 5)]
    # after the warm-up every stage counts the timed requests only: the same micro-batches and tokens
    assert run.stages[0]["batches"] == run.stages[1]["batches"] > 0
    assert run.stages[0]["tokens"] == run.stages[1]["tokens"]


def test_three_stages_with_cpp(tiny_dirs, tmp_path):
    """Untied 6-layer model split 2/1/3; a ~900-token prompt is cut into CPP chunks."""
    model = tiny_dirs["untied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 3), (3, 6)], micro_batches=2)
    long_prompt = "Attention is all you need. Large language models predict the next token. " * 28
    prompts = [*PROMPTS[:2], long_prompt]
    options = RunOptions(plan, model, prompts=prompts, max_tokens=8, ignore_eos=True, cpp_min_tokens=64)
    run = run_pipeline(options)
    expected = reference(model, prompts, [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 3)
    assert [r["token_ids"] for r in run.requests] == expected
    first = run.stages[0]
    assert first["cpp_prompts"] >= 1 and first["cpp_chunks"] > first["cpp_prompts"]
    # every stage ran every micro-batch
    assert len({s["batches"] for s in run.stages}) == 1


def test_cli_launch_prints_and_writes_json(tiny_dirs, tmp_path):
    from typer.testing import CliRunner

    from tessel.cli import app

    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 3), (3, 5)])
    out = tmp_path / "out.json"
    args = [
        "launch",
        "--plan",
        str(plan),
        "--model",
        str(model),
        "--prompt",
        "Hello world",
        "--prompt",
        "Once",
    ]
    result = CliRunner().invoke(app, [*args, "--max-tokens", "6", "--ignore-eos", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "stage 0 (cpu) -> stage 1 (cpu): gloo, host memory" in result.output  # the link, at start
    refused = CliRunner().invoke(app, [*args, "--transport", "nccl"])
    assert isinstance(refused.exception, TesselError) and refused.exception.exit_code == 2
    assert "a CPU stage has no NCCL" in str(refused.exception)
    expected = LLM(model).generate(
        ["Hello world", "Once"],
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        use_progress=False,
    )
    written = json.loads(out.read_text())
    assert [r["token_ids"] for r in written["requests"]] == [o.token_ids for o in expected]
    assert [r["text"] for r in written["requests"]] == [o.text for o in expected]
    assert result.output.count("finish_reason=length") == 2


def test_each_stage_sizes_its_kv_from_its_own_budget(tiny_dirs, tmp_path):
    """The plan reserves 1 MiB of KV for stage 0 (1 layer) and 64 MiB for stage 1 (4 layers): stage 0's
    budget holds fewer blocks, so every stage uses that many (they share stage 0's block tables), and
    the tokens are the single process's."""
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 1), (1, 5)])
    document = json.loads(plan.read_text())
    document["stages"][0]["kv_gib"], document["stages"][1]["kv_gib"] = 1 / 1024, 64 / 1024
    plan.write_text(json.dumps(document))
    config = json.loads((model / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_layer_block = 2 * 16 * config["num_key_value_heads"] * head_dim * 4  # k and v, 16 tokens, fp32
    run = run_pipeline(RunOptions(plan, model, prompts=PROMPTS[:2], max_tokens=6, ignore_eos=True))
    assert [s["kv_blocks"] for s in run.stages] == [2**20 // per_layer_block] * 2
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 2
    assert [r["token_ids"] for r in run.requests] == reference(model, PROMPTS[:2], params)
