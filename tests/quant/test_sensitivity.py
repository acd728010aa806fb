"""`tessel quantize --sensitivity`: per-layer KL costs that `tessel plan --sensitivity` reads.

Oracles: transformers' own forward of the whole model with one layer quantised by hand (the
cached partial re-run must give the same KL), and a layer made fragile on purpose (weight
outliers) must cost the most at int4.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import tiny_models
from tessel.catalog.models import load_model
from tessel.cli import app
from tessel.errors import TesselError
from tessel.models.quantized.schemes import make_scheme, quantize_weight
from tessel.plan.api import PlanSettings, make_plan
from tessel.plan.precision.quality import SensitivityFile
from tessel.quant.calibrate import calibration_windows, load_hf_model
from tessel.quant.sensitivity import (
    SENSITIVITY_PRECISIONS,
    SensitivityOptions,
    _float_pass,
    _logits_from,
    fake_quantized,
    int4_group_size,
    measure_sensitivity,
    parse_sensitivity_precisions,
    precision_scheme,
)

SMALL = ["--calib-samples", "3", "--seq-len", "24"]
CLUSTER = "mixed-a100-v100-t4"


def _invoke(args: list) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def sensitivity_file(tiny_llama: Path, calib_text: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sens") / "costs.json"
    result = _invoke(["quantize", tiny_llama, "--sensitivity", out, "--calib", calib_text, *SMALL])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_llama: Path):
    return load_hf_model(tiny_llama)


def _windows(tokenizer, calib_text: Path, samples: int = 3, seq_len: int = 24) -> torch.Tensor:
    return calibration_windows(calib_text.read_text(encoding="utf-8"), tokenizer, samples, seq_len)


def test_the_file_is_what_the_planner_reads(sensitivity_file: Path, tiny_llama: Path) -> None:
    data = SensitivityFile.model_validate_json(sensitivity_file.read_text())
    spec = load_model(tiny_llama)
    assert (data.model, data.num_layers) == (spec.name, spec.num_layers)
    assert set(data.costs) == set(SENSITIVITY_PRECISIONS)
    for values in data.costs.values():
        assert len(values) == spec.num_layers
        assert all(math.isfinite(v) and v >= 0 for v in values)
    # int4 moves the model further than int8 on every layer of a random model
    assert all(four > eight > 0 for four, eight in zip(data.costs["int4"], data.costs["int8"], strict=True))
    outcome = make_plan(
        tiny_llama,
        CLUSTER,
        "default",
        PlanSettings(precisions="fp16,int8,int4", sensitivity=sensitivity_file),
    )
    assert outcome.instance.labels["quality_source"] == "sensitivity"
    assert outcome.plan_file().quality.source == "sensitivity"


def test_plan_cli_accepts_the_file(sensitivity_file: Path, tiny_llama: Path) -> None:
    args = ["plan", "--model", tiny_llama, "--cluster", CLUSTER, "--precisions", "fp16,int8"]
    result = _invoke([*args, "--sensitivity", sensitivity_file])
    assert result.exit_code == 0, result.output
    other = sensitivity_file.with_name("other.json")
    other.write_text(json.dumps(json.loads(sensitivity_file.read_text()) | {"model": "another"}))
    refused = _invoke([*args, "--sensitivity", other])
    assert isinstance(refused.exception, TesselError) and "measured on another" in str(refused.exception)


def test_the_cached_rerun_reproduces_the_float_model(hf_model, calib_text: Path) -> None:
    model, tokenizer = hf_model
    window = _windows(tokenizer, calib_text)[1]
    calls, reference = _float_pass(model, window)
    expected = torch.log_softmax(model(input_ids=window[None]).logits[0].float(), dim=-1)
    torch.testing.assert_close(reference, expected, rtol=0, atol=0)
    for start in range(len(calls)):
        rerun = torch.log_softmax(_logits_from(model, calls, start).float(), dim=-1)
        torch.testing.assert_close(rerun, reference, rtol=1e-6, atol=1e-6)


def _hand_quantised(model, layer: int, precision: str):
    """A copy of `model` with layer `layer`'s linears rounded by hand: weights through the shared
    round-to-nearest quantiser, W8A8 inputs per token as amax / 127 with ties to even."""
    model = copy.deepcopy(model)
    hidden, ffn = model.config.hidden_size, model.config.intermediate_size
    assert hidden % 128 and not hidden % 64 and not ffn % 64  # so int4 takes groups of 64
    group = 64 if precision == "int4" else None
    scheme = make_scheme("w4a16", group_size=group) if precision == "int4" else make_scheme("w8a8")
    for module in model.model.layers[layer].modules():
        if isinstance(module, torch.nn.Linear):
            with torch.no_grad():
                module.weight.copy_(quantize_weight(module.weight, scheme).dequantize())
            if precision == "int8":

                def per_token(_m, args):
                    x = args[0].double()
                    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127
                    return (torch.clamp(torch.round(x / scale), -127, 127) * scale).to(args[0].dtype)

                module.register_forward_pre_hook(per_token)
    return model


@pytest.mark.parametrize("precision", SENSITIVITY_PRECISIONS)
@pytest.mark.parametrize("layer", [0, 1])
def test_cost_equals_transformers_with_one_layer_quantised(hf_model, calib_text, precision, layer) -> None:
    model, tokenizer = hf_model
    windows = _windows(tokenizer, calib_text)
    measured = measure_sensitivity(model, windows, (precision,))[precision][layer]
    quantised = _hand_quantised(model, layer, precision)
    total = 0.0
    with torch.no_grad():
        for window in windows:
            p = torch.log_softmax(model(input_ids=window[None]).logits[0].double(), dim=-1)
            q = torch.log_softmax(quantised(input_ids=window[None]).logits[0].double(), dim=-1)
            total += float((p.exp() * (p - q)).sum())
    expected = total / windows.numel()
    assert expected > 0
    assert measured == pytest.approx(expected, rel=2e-3, abs=1e-7)


def test_fake_quantized_restores_the_weights(hf_model) -> None:
    model, _ = hf_model
    layer = model.model.layers[0]
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    with pytest.raises(RuntimeError), fake_quantized(layer, precision_scheme("int8", [64, 128])):
        assert not torch.equal(layer.self_attn.q_proj.weight, before["self_attn.q_proj.weight"])
        assert layer.self_attn.q_proj._forward_pre_hooks
        raise RuntimeError("interrupted")
    after = dict(layer.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert not layer.self_attn.q_proj._forward_pre_hooks


def test_a_fragile_layer_costs_the_most_at_int4(tmp_path: Path, calib_text: Path) -> None:
    path = tiny_models.make_tiny_checkpoint(tmp_path / "deep", "llama", seed=11, num_hidden_layers=4)
    model, tokenizer = load_hf_model(path)
    fragile = 2
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.model.layers[fragile].modules():
            if isinstance(module, torch.nn.Linear):
                rows = torch.arange(module.out_features)
                cols = torch.randint(0, module.in_features, (module.out_features,), generator=generator)
                module.weight[rows, cols] *= 25.0  # one outlier per row sets its groups' scale
    costs = measure_sensitivity(model, _windows(tokenizer, calib_text), ("int4",))["int4"]
    assert max(range(4), key=costs.__getitem__) == fragile, costs


@pytest.mark.parametrize(
    ("in_features", "group"), [([4096, 11008], 128), ([576, 1536], 64), ([64, 128], 64), ([96, 128], 32)]
)
def test_int4_group_is_the_largest_the_model_allows(in_features, group) -> None:
    assert int4_group_size(in_features) == group
    assert precision_scheme("int4", in_features).group_size == group


def _bad_cases(tmp_path: Path, calib_text: Path) -> list[tuple[list, str]]:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    out = tmp_path / "out" / "costs.json"
    return [
        ([out, "--calib", empty, *SMALL], "--calib"),
        ([out, "--calib", calib_text, "--calib-samples", "400", "--seq-len", "512"], "--calib-samples"),
        ([out, "--calib", calib_text, *SMALL, "--precisions", "int8,fp8"], "--precisions"),
        ([out, "--calib", calib_text, *SMALL, "--precisions", "int8,,int4"], "--precisions"),
        ([out, *SMALL], "--calib"),
        ([calib_text / "costs.json", "--calib", calib_text, *SMALL], "--sensitivity"),
        ([tmp_path, "--calib", calib_text, *SMALL], "--sensitivity"),
    ]


def test_bad_input_exits_2_naming_the_field_and_writes_nothing(tiny_llama, calib_text, tmp_path) -> None:
    for args, field in _bad_cases(tmp_path, calib_text):
        result = _invoke(["quantize", tiny_llama, "--sensitivity", *args])
        assert isinstance(result.exception, TesselError), (args, result.output)
        assert result.exception.exit_code == 2 and field in str(result.exception), (field, result.exception)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.rglob("*") if "partial" in p.name]
    both = _invoke(["quantize", tiny_llama, "--out", tmp_path / "ckpt", "--sensitivity", tmp_path / "s.json"])
    assert isinstance(both.exception, TesselError) and "one of --out" in str(both.exception)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "s.json").exists()


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("int48,fp16 \tINT")), max_size=24) | st.text(max_size=24))
def test_precisions_option_fuzz(text: str) -> None:
    try:
        names = parse_sensitivity_precisions(text)
    except TesselError as error:
        assert "--precisions" in str(error)
        return
    assert names and set(names) <= set(SENSITIVITY_PRECISIONS) and len(set(names)) == len(names)
    SensitivityOptions(Path("calib.txt"), names)


@settings(max_examples=100, deadline=None)
@given(st.integers(-(2**40), 2**40), st.integers(-(2**40), 2**40))
def test_sensitivity_options_fuzz(samples: int, seq_len: int) -> None:
    try:
        options = SensitivityOptions(Path("calib.txt"), ("int8",), samples, seq_len)
    except TesselError as error:
        assert "--calib-samples" in str(error) or "--seq-len" in str(error)
        return
    assert options.calib_samples >= 1 and options.seq_len >= 2


@settings(max_examples=25, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("int48,fp16 \x00\u00e9")), max_size=12))
def test_cli_precisions_fuzz(tiny_llama: Path, calib_text: Path, tmp_path_factory, text: str) -> None:
    out = tmp_path_factory.mktemp("fuzz") / "costs.json"
    args = ["quantize", tiny_llama, "--sensitivity", out, "--calib", calib_text, *SMALL, "--precisions", text]
    result = _invoke(args)
    if result.exit_code == 0:
        assert set(SensitivityFile.model_validate_json(out.read_text()).costs) <= set(SENSITIVITY_PRECISIONS)
    else:
        assert isinstance(result.exception, TesselError) and result.exception.exit_code == 2, result.output
        assert not out.exists()
