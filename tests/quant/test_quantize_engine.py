"""`tessel quantize` end to end on a tiny checkpoint, and the engine running what it wrote.

Oracles: HF transformers loads the checkpoint through the `compressed-tensors` package (which
de-quantises the weights); for W8A8 the HF model's linears additionally see their inputs
fake-quantised (per token, or by the static input scale), which is the function the engine's
int8 GEMM computes. Bad input: a clear message naming the field, exit code 2, nothing in --out.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ct_oracle import engine_logits, hf_quantized
from tessel import LLM, SamplingParams
from tessel.cli import app
from tessel.errors import TesselError
from tessel.layers.linear import W8A8Linear
from tessel.quant.calibrate import calibration_windows, read_calibration_text

CASES = {
    "w8a8": ["--scheme", "w8a8"],
    "w8a8-static-entropy-sq": [
        "--scheme",
        "w8a8",
        "--act",
        "static",
        "--observer",
        "entropy",
        "--smoothquant",
        "0.5",
    ],
    "w8a8-static-mse": [
        "--scheme",
        "w8a8",
        "--act",
        "static",
        "--observer",
        "mse",
        "--weight-observer",
        "mse",
    ],
    "w8a8-sq-auto": ["--scheme", "w8a8", "--smoothquant", "auto"],
    "w8a16": ["--scheme", "w8a16"],
    "w4a16-g32": ["--scheme", "w4a16", "--group-size", "32"],
    "w4a16-g32-gptq": ["--scheme", "w4a16", "--group-size", "32", "--method", "gptq"],
    "w4a16-g32-awq-gptq": [
        "--scheme",
        "w4a16",
        "--group-size",
        "32",
        "--awq",
        "--method",
        "gptq",
        "--static-groups",
    ],  # fmt: skip
    "w8a8-sq-gptq-act-order": ["--scheme", "w8a8", "--smoothquant", "0.5", "--method", "gptq", "--act-order"],
    "w4a16-g32-asym": ["--scheme", "w4a16", "--group-size", "32", "--asym"],
    "w4a16-g32-asym-awq-gptq-act-order-mse": [
        "--scheme",
        "w4a16",
        "--group-size",
        "32",
        "--asym",
        "--awq",
        "--method",
        "gptq",
        "--act-order",
        "--weight-observer",
        "mse",
    ],  # fmt: skip
    "w8a16-asym": ["--scheme", "w8a16", "--asym"],
}
CALIB = ["--calib-samples", "4", "--seq-len", "32"]


@functools.cache
def _tokenizer():
    import tiny_models

    return tiny_models.build_tokenizer()


def _quantize(tiny_llama, calib_text, out, args: list[str]):
    result = CliRunner().invoke(
        app, ["quantize", str(tiny_llama), "--out", str(out), *CALIB, "--calib", str(calib_text), *args]
    )
    return result


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_loads_in_hf_and_the_engine_matches_it(
    tiny_llama, calib_text, tmp_path, case: str
) -> None:
    out = tmp_path / case
    result = _quantize(tiny_llama, calib_text, out, CASES[case])
    assert result.exit_code == 0, result.output + repr(result.exception)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["ignore"] == ["lm_head"]
    assert (out / "tokenizer.json").exists()
    ids = torch.randint(4, 300, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = hf_quantized(out)(torch.tensor([ids])).logits[0]
    got = engine_logits(out, ids)
    scale = float(expected.abs().max())
    # W8A8: a token whose activation sits on a rounding tie may round the other way (fp32 vs int32 sums)
    tol = 2e-3 if "w8a8" in case else 1e-4
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * scale)
    fp = engine_logits(tiny_llama, ids)
    assert float((got - fp).abs().max()) > 0  # it really is quantised
    relative = float((got - fp).norm() / fp.norm())
    assert relative < (0.5 if "w4" in case else 0.1), relative  # near the float model (int4: 15 levels)


def test_engine_swaps_in_w8a8_modules_and_generates(tiny_llama, calib_text, tmp_path) -> None:
    out = tmp_path / "w8a8"
    assert _quantize(tiny_llama, calib_text, out, ["--scheme", "w8a8"]).exit_code == 0
    llm = LLM(out, max_model_len=128)
    kinds = {type(m) for m in llm.model.model.layers.modules()}
    assert W8A8Linear in kinds and torch.nn.Linear not in kinds
    result = CliRunner().invoke(
        app, ["generate", "--model", str(out), "--prompt", "Hello world", "--max-tokens", "5"]
    )
    assert result.exit_code == 0, result.output
    expected = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=5))[0].text
    assert expected.strip() in result.output


def test_7bit_weight_codes_are_an_int8_checkpoint_run_on_fbgemm(
    tiny_llama, calib_text, tmp_path, monkeypatch
) -> None:
    """`--weight-code-bits 7`: an ordinary int8 compressed-tensors checkpoint (num_bits 8) whose
    codes lie in [-63, 63]. HF reads it; the engine's exact path matches HF; on an AVX2 CPU
    (flags patched) the engine runs fbgemm's int8 GEMM with 8-bit activations (its own rounding
    of each row), as near the float model as the exact path is."""
    from safetensors.torch import load_file

    from tessel.kernels import cpu_features
    from tessel.kernels.int8_cpu import fits_7bit_codes

    out = tmp_path / "w7"
    args = ["--scheme", "w8a8", "--weight-code-bits", "7", "--smoothquant", "0.5", "--method", "gptq"]
    result = _quantize(tiny_llama, calib_text, out, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert next(iter(config["config_groups"].values()))["weights"]["num_bits"] == 8
    tensors = load_file(str(out / "model.safetensors"))
    codes = [t for name, t in tensors.items() if t.dtype == torch.int8]
    assert codes and all(int(t.abs().max()) <= 63 for t in codes)
    assert max(int(t.abs().max()) for t in codes) == 63
    ids = torch.randint(4, 300, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = hf_quantized(out)(torch.tensor([ids])).logits[0]
    scale = float(expected.abs().max())
    monkeypatch.setenv("TESSEL_INT8_PATH", "dequant")
    exact = engine_logits(out, ids)
    torch.testing.assert_close(exact, expected, rtol=2e-3, atol=2e-3 * scale)
    if not cpu_features.fbgemm_available():
        return
    monkeypatch.delenv("TESSEL_INT8_PATH")
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))
    llm = LLM(out, max_model_len=128)
    linears = [m for m in llm.model.modules() if isinstance(m, W8A8Linear)]
    assert linears and all(fits_7bit_codes(m.weight) for m in linears)
    assert {(m.path, m.plan.fbgemm_act_bits) for m in linears} == {("fbgemm", 8)}
    got = engine_logits(out, ids)
    fp = engine_logits(tiny_llama, ids)
    exact_error, fbgemm_error = float((exact - fp).norm()), float((got - fp).norm())
    assert fbgemm_error < 1.25 * exact_error, (fbgemm_error, exact_error)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scheme", "w4a16"], "group size 128 does not divide in_features 64"),
        (["--scheme", "w8a16", "--weight-code-bits", "7"], "--weight-code-bits 7 applies to w8a8"),
        (["--scheme", "w8a8", "--weight-code-bits", "6"], "--weight-code-bits must be 8 or 7"),
        (["--scheme", "w8a16", "--act", "static"], "--act static"),
        (["--scheme", "w8a8", "--asym"], "--asym applies to weight-only schemes"),
        (["--scheme", "w8a8", "--act", "static", "--calib-samples", "5000"], "--calib-samples 5000"),
        (["--scheme", "w9a9"], "--scheme"),
        (["--scheme", "w8a8", "--observer", "kmeans"], "--observer"),
        (["--scheme", "w8a8", "--smoothquant", "1.5"], "alpha"),
        (["--scheme", "w8a8", "--smoothquant", "best"], "'auto'"),
        (["--scheme", "w8a8", "--method", "awq"], "--method"),
        (["--scheme", "w8a8", "--act-order"], "--act-order applies to --method gptq"),
        (["--scheme", "w8a16", "--awq", "--smoothquant", "0.5"], "--awq and --smoothquant"),
        (["--scheme", "w8a16", "--static-groups"], "--static-groups applies to --method gptq"),
        (
            ["--scheme", "w4a16", "--group-size", "32", "--method", "gptq", "--calib-samples", "5000"],
            "--calib-samples 5000",
        ),
    ],
)
def test_bad_input_is_a_user_error_and_writes_nothing(
    tiny_llama, calib_text, tmp_path, args, message
) -> None:
    out = tmp_path / "out"
    result = _quantize(tiny_llama, calib_text, out, args)
    assert result.exit_code != 0
    assert isinstance(result.exception, TesselError) and message in str(result.exception)
    assert list(tmp_path.iterdir()) == []


def test_empty_calibration_file_exits_2_without_traceback(tiny_llama, tmp_path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", "from tessel.cli import main; main()", "quantize", str(tiny_llama)]
    cmd += ["--out", str(out), "--act", "static", "--calib", str(empty)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert done.returncode == 2
    stderr = " ".join(done.stderr.split())  # rich wraps long lines
    assert "is empty" in stderr and "Traceback" not in stderr
    assert not out.exists()


def test_unsupported_checkpoint_config_names_the_field(tiny_llama, calib_text, tmp_path) -> None:
    out = tmp_path / "w8a8"
    assert _quantize(tiny_llama, calib_text, out, ["--scheme", "w8a8"]).exit_code == 0
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 2
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(TesselError, match="weights.num_bits"):
        LLM(out, max_model_len=64)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=400), samples=st.integers(1, 4), seq_len=st.integers(2, 40))
def test_hostile_calibration_files_give_windows_or_a_tessel_error(tmp_path, data, samples, seq_len) -> None:
    path = tmp_path / "calib.bin"
    path.write_bytes(data)
    try:
        windows = calibration_windows(read_calibration_text(path), _tokenizer(), samples, seq_len)
    except TesselError:
        return
    assert windows.shape == (samples, seq_len) and windows.dtype == torch.int64


@pytest.mark.parametrize("case", ["w8a8-sq", "w4a16-g32-gptq"])
def test_a_qwen3_checkpoint_quantises_and_the_engine_matches_it(calib_text, tmp_path, case: str) -> None:
    """Qwen3's layers map as Llama's (its q/k norms sit after the projections SmoothQuant scales)."""
    import tiny_models

    qwen3 = tiny_models.make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", seed=4)
    args = {"w8a8-sq": ["--scheme", "w8a8", "--smoothquant", "0.5"]}.get(case)
    args = args or ["--scheme", "w4a16", "--group-size", "32", "--method", "gptq"]
    out = tmp_path / case
    result = _quantize(qwen3, calib_text, out, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    ids = torch.randint(4, 300, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = hf_quantized(out)(torch.tensor([ids])).logits[0]
    got = engine_logits(out, ids)
    tol = 2e-3 if "w8a8" in case else 1e-4
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * float(expected.abs().max()))
