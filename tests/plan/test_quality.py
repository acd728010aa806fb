"""Quality indicators: shape-based default, measured on a real checkpoint's weights, sensitivity files;
the default budget; bad input through the CLI (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tessel.catalog.models import load_model
from tessel.cli import app
from tessel.errors import TesselError
from tessel.plan.build import build_instance
from tessel.plan.precision.quality import quality_costs, relative_error, shape_costs, weight_costs


def test_shape_costs_grow_as_bits_drop() -> None:
    costs = shape_costs(load_model("llama-3-70b"), ("fp16", "bf16", "int8", "int4"))
    for kind in ("attention", "mlp"):
        assert costs[kind][0] == 0.0
        assert 0.0 < costs[kind][1] < costs[kind][2] < costs[kind][3]


def test_default_budget_allows_int8_on_half_the_layers_and_no_int4() -> None:
    instance = build_instance("llama-3-70b", "llmpq-t4-v100", "default", precisions=("fp16", "int8", "int4"))
    choice = instance.precision
    half = np.zeros(80, dtype=int)
    half[:40] = 1
    assert instance.quality_cost(half) <= choice.quality_budget * (1 + 1e-9)
    half[40] = 1
    assert instance.quality_cost(half) > choice.quality_budget
    one_int4 = np.zeros(80, dtype=int)
    one_int4[7] = 2
    assert instance.quality_cost(one_int4) > choice.quality_budget


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_int8_error_matches_torch_per_channel_quantisation() -> None:
    torch = pytest.importorskip("torch")  # the oracle: torch's per-channel int8 quantiser
    rng = np.random.default_rng(0)
    weights = (rng.standard_t(4, size=(37, 130)) * 0.02).astype(np.float32)
    w = torch.from_numpy(weights)
    scales = w.abs().amax(dim=1).double() / 127
    q = torch.quantize_per_channel(w, scales, torch.zeros(37, dtype=torch.long), 0, torch.qint8)
    expected = float(((w - q.dequantize()) ** 2).sum() / (w**2).sum())
    assert relative_error(weights, "int8") == pytest.approx(expected, rel=1e-4)


def test_int4_error_matches_group_quantisation_in_float64() -> None:
    rng = np.random.default_rng(1)
    weights = rng.normal(size=(5, 256)).astype(np.float32)
    w = weights.astype(np.float64)
    expected_num = 0.0
    for row in w:
        for group in row.reshape(2, 128):
            scale = np.abs(group).max() / 7
            expected_num += float(np.sum((group - np.clip(np.round(group / scale), -8, 7) * scale) ** 2))
    assert relative_error(weights, "int4") == pytest.approx(expected_num / float(np.sum(w * w)), rel=1e-9)


def test_int4_error_groups_a_row_that_128_does_not_divide() -> None:
    rng = np.random.default_rng(2)
    weights = rng.normal(size=(3, 300)).astype(np.float32)
    weights[:, 256:] *= 0.01  # a small-valued tail: one row-wide scale would round it to nothing
    w = weights.astype(np.float64)
    expected_num = 0.0
    for row in w:
        for group in (row[:128], row[128:256], row[256:]):
            scale = np.abs(group).max() / 7
            expected_num += float(np.sum((group - np.clip(np.round(group / scale), -8, 7) * scale) ** 2))
    assert relative_error(weights, "int4") == pytest.approx(expected_num / float(np.sum(w * w)), rel=1e-9)


def test_weight_costs_on_a_real_checkpoint(smollm2_dir) -> None:
    model = load_model(smollm2_dir)
    costs = weight_costs(model, ("fp16", "int8", "int4"), smollm2_dir)
    total = costs["attention"] + costs["mlp"]
    assert total.shape == (model.num_layers, 3)
    assert np.all(total[:, 0] == 0) and np.all(total[:, 1] > 0) and np.all(total[:, 2] > total[:, 1])
    # the shape indicator is the expectation for Gaussian weights: same order of magnitude
    shape = shape_costs(model, ("fp16", "int8", "int4"))
    ratio = total[:, 1].mean() / (shape["attention"][1] + shape["mlp"][1])
    assert 0.1 < ratio < 10


def test_checkpoint_for_another_model_is_refused(smollm2_dir) -> None:
    with pytest.raises(TesselError, match="no weights found for layer"):
        quality_costs(load_model("llama-3-70b"), ("fp16", "int8"), ("layer",), checkpoint=smollm2_dir)


def _sensitivity(tmp_path, model="llama-3-70b", layers=80, costs=None):
    path = tmp_path / "sens.json"
    costs = costs if costs is not None else {"int8": [0.01] * layers, "int4": [0.3] * layers}
    path.write_text(json.dumps({"model": model, "num_layers": layers, "costs": costs}))
    return path


def test_sensitivity_file_costs_are_used(tmp_path) -> None:
    costs = {"int8": list(np.linspace(0.0, 1.0, 80)), "int4": [5.0] * 80}
    path = _sensitivity(tmp_path, costs=costs)
    quality, source = quality_costs(
        load_model("llama-3-70b"), ("fp16", "int8", "int4"), ("layer",), sensitivity=path
    )
    assert source == "sensitivity"
    assert np.allclose(quality[:, 1], costs["int8"]) and np.allclose(quality[:, 2], 5.0)
    halves, _ = quality_costs(
        load_model("llama-3-70b"), ("fp16", "int8"), ("attention", "mlp"), sensitivity=path
    )
    assert np.allclose(halves[0::2, 1] + halves[1::2, 1], costs["int8"])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"model": "mistral-7b", "layers": 32}, "measured on mistral-7b"),
        ({"layers": 40}, "40 layers"),
        ({"costs": {"int8": [0.1] * 80}}, "no costs for int4"),
        ({"costs": {"int8": [0.1] * 79, "int4": [1.0] * 80}}, "needs 80 finite numbers"),
        ({"costs": {"int8": [-1.0] * 80, "int4": [1.0] * 80}}, "needs 80 finite numbers"),
    ],
)
def test_bad_sensitivity_files_are_refused(tmp_path, kwargs, match) -> None:
    path = _sensitivity(tmp_path, **kwargs)
    with pytest.raises(TesselError, match=match):
        quality_costs(load_model("llama-3-70b"), ("fp16", "int8", "int4"), ("layer",), sensitivity=path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_sensitivity_reader_fuzz(tmp_path, data: bytes) -> None:
    path = tmp_path / "fuzz.json"
    path.write_bytes(data)
    try:
        quality_costs(load_model("llama-3-70b"), ("fp16", "int8"), ("layer",), sensitivity=path)
    except TesselError:
        pass


@pytest.mark.parametrize(
    "args,match",
    [
        (["--precisions", "fp16,,int8"], "empty precision"),
        (["--precisions", "fp16,int2"], "unknown precision"),
        (["--quality-budget", "1"], "need --precisions"),
        (["--precisions", "fp16,int8", "--quality-budget", "-1"], "-1 is below 0"),
    ],
)
def test_cli_refuses_bad_precision_options(args, match) -> None:
    result = _run_cli("plan", "--cluster", "llmpq-t4-v100", *args)
    assert result.returncode == 2, result.stderr
    assert match in result.stderr and "Traceback" not in result.stderr


def test_cli_refuses_sensitivity_for_another_model(tmp_path) -> None:
    path = _sensitivity(tmp_path, model="mistral-7b", layers=32)
    result = _run_cli(
        "plan", "--cluster", "llmpq-t4-v100", "--precisions", "fp16,int8", "--sensitivity", str(path)
    )
    assert result.returncode == 2 and "measured on mistral-7b" in result.stderr


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tessel.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_shows_each_stages_precisions() -> None:
    result = CliRunner().invoke(
        app,
        ["plan", "--cluster", "llmpq-t4-v100", "--precisions", "fp16,int8", "--time-limit", "4"],
    )
    assert result.exit_code == 0, result.output
    assert "precisions" in result.output and "int8 x" in result.output
