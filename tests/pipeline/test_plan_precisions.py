"""The pipeline runtime runs a plan's per-layer weight precisions (round to nearest at load time).

Oracle: HF transformers on the same float checkpoint with each int8 layer's linear weights rounded
per output channel by torch.ao's observer ([-127, 127], symmetric) and their inputs rounded per
token (`ct_oracle.fake_quant`: the function of tessel's int8 GEMM), each int4 layer's weights
rounded per group ([-8, 7], scale max|w| / 7.5, in float32 as compressed-tensors rounds). The
single-stage in-process pipeline is held to its logits; the two-process pipeline to the single-stage
one's tokens; a replica of a replica plan to the single-process engine's tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from ct_oracle import fake_quant
from loopback_stage import pipeline_llm
from pipeline_plans import write_plan, write_replica_plan
from tessel import LLM, SamplingParams
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence
from tessel.errors import TesselError
from tessel.layers.linear import W8A8Linear
from tessel.models.quantized.load_quantize import int4_group, quantized_linear
from tessel.pipeline.run import RunOptions, run_pipeline
from tessel.pipeline.run_plan import load_run_plan, priced_pipeline

HF_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def plan_with_precisions(path, model, splits, precisions: list[list[str]], granularity="layer"):
    """A version-2 plan: stage i's units get precisions[i]."""
    write_plan(path, model, splits)
    plan = json.loads(path.read_text())
    per = 2 if granularity == "sublayer" else 1
    plan.update(version=2, granularity=granularity, precisions=sorted({p for s in precisions for p in s}))
    for stage, names in zip(plan["stages"], precisions, strict=True):
        stage.update(
            unit_start=stage["layer_start"] * per, unit_end=stage["layer_end"] * per, precisions=names
        )
    path.write_text(json.dumps(plan))
    return path


def _int8_weight(w: torch.Tensor) -> torch.Tensor:
    obs = torch.ao.quantization.PerChannelMinMaxObserver(
        ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric, quant_min=-127, quant_max=127
    )
    obs(w)
    scale, _ = obs.calculate_qparams()
    return torch.fake_quantize_per_channel_affine(
        w, scale.float(), torch.zeros_like(scale).int(), 0, -127, 127
    )


def _int4_weight(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    g = w.float().reshape(n, k // int4_group(k), -1)  # float32, as compressed-tensors rounds
    scale = g.abs().amax(dim=2, keepdim=True) / 7.5
    return (torch.clamp(torch.round(g / scale), -8, 7) * scale).reshape(n, k)


def hf_oracle(model_dir, layer_precisions: dict[int, str]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for index, precision in layer_precisions.items():
        layer = model.model.layers[index]
        for module in layer.modules():
            name = next((n for n, m in layer.named_modules() if m is module), "")
            if not isinstance(module, torch.nn.Linear) or name.rsplit(".", 1)[-1] not in HF_LINEARS:
                continue
            with torch.no_grad():
                w = module.weight
                w.copy_(_int8_weight(w) if precision == "int8" else _int4_weight(w))
            if precision == "int8":
                module.register_forward_pre_hook(lambda _m, args: (fake_quant(args[0], None),))
    return model


def pipeline_logits(engine: LLM, ids: list[int]) -> torch.Tensor:
    seq = Sequence("x", ids, SamplingParams(temperature=0), block_size=8)
    engine.block_manager.allocate(seq, 0)
    return engine.runner.forward_logits(SchedulerOutput(prefills=[(seq, len(ids))]))


PRECISIONS = ["int8", "fp16", "int4", "int8", "fp32"]  # the tied 5-layer model, one stage


def test_run_plan_reads_layer_and_sublayer_precisions(tiny_dirs, tmp_path):
    model = tiny_dirs["tied"]
    plan = load_run_plan(
        plan_with_precisions(tmp_path / "p.json", model, [(0, 2), (2, 5)], [PRECISIONS[:2], PRECISIONS[2:]])
    )
    assert plan.stages[0].quantized_layers == {0: ("int8", "int8")}
    assert plan.stages[1].quantized_layers == {2: ("int4", "int4"), 3: ("int8", "int8")}
    units = ["int8", "fp16", "fp16", "int4", "fp16", "fp16"]
    sub = plan_with_precisions(
        tmp_path / "s.json", model, [(0, 3), (3, 5)], [units, ["fp16"] * 4], "sublayer"
    )
    assert load_run_plan(sub).stages[0].quantized_layers == {0: ("int8", "fp16"), 1: ("fp16", "int4")}


def test_one_stage_with_mixed_precisions_matches_transformers(tiny_dirs, tmp_path):
    model = tiny_dirs["tied"]
    plan = plan_with_precisions(tmp_path / "p.json", model, [(0, 5)], [PRECISIONS])
    engine = pipeline_llm(model, plan, max_model_len=128, block_size=8)
    layers = engine.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, W8A8Linear) and isinstance(
        layers[3].mlp.down_proj, W8A8Linear
    )
    assert not isinstance(layers[2].mlp.down_proj, W8A8Linear)
    ids = torch.randint(4, 300, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    got = pipeline_logits(engine, ids)
    quantised = {i: p for i, p in enumerate(PRECISIONS) if p in ("int8", "int4")}
    with torch.no_grad():
        expected = hf_oracle(model, quantised)(torch.tensor([ids])).logits[0]
        plain = hf_oracle(model, {})(torch.tensor([ids])).logits[0]
    scale = float(expected.abs().max())
    # a token whose activation sits on a rounding tie may round the other way (fp32 vs int32 sums)
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3 * scale)
    assert float((got - plain).abs().max()) > 1e-3 * scale  # it really is quantised


@pytest.mark.slow
def test_two_stage_processes_run_their_precisions(tiny_dirs, tmp_path):
    """Stage 0 (int8 layers) and stage 1 (int4 + fp32) in their own processes: the tokens of the
    one-stage pipeline with the same precisions (held to transformers above)."""
    model = tiny_dirs["tied"]
    prompts = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 3]
    two = plan_with_precisions(
        tmp_path / "two.json", model, [(0, 2), (2, 5)], [PRECISIONS[:2], PRECISIONS[2:]]
    )
    run = run_pipeline(RunOptions(two, model, prompts=prompts, max_tokens=8, ignore_eos=True))
    one = plan_with_precisions(tmp_path / "one.json", model, [(0, 5)], [PRECISIONS])
    engine = pipeline_llm(model, one)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [out.token_ids for out in engine.generate(prompts, params, use_progress=False)]
    assert [r["token_ids"] for r in run.requests] == expected
    assert [s["state"] for s in run.stages] == ["done", "done"]


def test_a_precision_that_cannot_run_is_a_user_error():
    with pytest.raises(TesselError, match="cannot run"):
        quantized_linear(torch.nn.Linear(8, 4), "fp8", torch.float32)
    assert int4_group(576) == 64 and int4_group(4096) == 128
    with pytest.raises(TesselError, match="even row length"):
        int4_group(7)


def replica_plan(path, model):
    """Two pipelines: replica 0 on cpu0 + cpu1 (layers 0-1 | 2-4), replica 1 on cpu2 alone."""
    return write_replica_plan(path, model)


def test_a_replica_plan_runs_the_replica_asked_for(tiny_dirs, tmp_path):
    model = tiny_dirs["tied"]
    path = replica_plan(tmp_path / "replicas.json", model)
    with pytest.raises(TesselError, match=r"pass --replica K") as error:
        load_run_plan(path)
    assert "0 (2 stages, weight 0.625)" in str(error.value) and "1 (1 stages, weight 0.375)" in str(
        error.value
    )
    for bad in (2, -1):
        with pytest.raises(TesselError, match="numbered 0..1"):
            load_run_plan(path, bad)
    assert [(s.layer_start, s.layer_end) for s in load_run_plan(path, 0).stages] == [(0, 2), (2, 5)]
    solo = load_run_plan(path, 1)
    assert [(s.device, s.layer_start, s.layer_end) for s in solo.stages] == [("localhost/cpu2", 0, 5)]
    assert solo.micro_batches == 1  # its share of the micro-batches
    assert load_run_plan(path, 0).micro_batches == 2  # no share given: the plan's m
    # the CPP cut is priced on the replica's own stages (one device here, the first replica's two)
    assert len(priced_pipeline(solo).stages) == 1 and len(priced_pipeline(load_run_plan(path, 0)).stages) == 2
    prompts = ["Hello world", "Once upon a time there was a small model"]
    run = run_pipeline(RunOptions(path, model, prompts=prompts, max_tokens=6, ignore_eos=True, replica=1))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [out.token_ids for out in LLM(model).generate(prompts, params, use_progress=False)]
    assert [r["token_ids"] for r in run.requests] == expected


def test_serve_runs_one_replica_and_needs_a_plan_for_it(tiny_dirs, tmp_path):
    from typer.testing import CliRunner

    from tessel.cli import app
    from tessel.pipeline.options import RunOptions
    from tessel.pipeline.supervision.supervisor import Supervisor

    model = tiny_dirs["tied"]
    result = CliRunner().invoke(app, ["serve", "--model", str(model), "--replica", "1"])
    assert isinstance(result.exception, TesselError) and "give --plan too" in str(result.exception)
    options = RunOptions(replica_plan(tmp_path / "replicas.json", model), model, replica=1)
    engine = Supervisor.serve(options, max_rebuilds=0)
    try:
        assert [(s.device, s.layer_start, s.layer_end) for s in engine.executor.plan.stages] == [
            ("localhost/cpu2", 0, 5)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        got = engine.generate(["Hello world"], params, use_progress=False)[0].token_ids
        assert got == LLM(model).generate(["Hello world"], params, use_progress=False)[0].token_ids
    finally:
        engine.supervisor.close()
