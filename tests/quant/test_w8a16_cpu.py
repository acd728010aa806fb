"""The CPU W8A16 paths (`W8A16Linear`): each against float64, the path follows the CPU, and the
engine decoding a W8A16 checkpoint matches HF transformers step by step.

References: float64 `x @ (q * s).T + b` for `gemv`, `fp16codes` and `dequant` (float32 sums: 1e-5
relative);
for `bf16` the float64 sum of bf16(x) * q, whose bfloat16 rounding bounds the error (2**-8 relative
per output). HF loads the checkpoint through `compressed-tensors` (de-quantised float32 weights).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tessel import LLM, SamplingParams
from tessel.cli import app
from tessel.errors import TesselError
from tessel.kernels import cpu_compile, w8a16_cpu
from tessel.kernels.cpu_features import BF16_FLAGS, W8A16_ENV_OVERRIDE, choose_w8a16_path, cpu_flags
from tessel.kernels.quantize_rows import quantize_per_token
from tessel.layers.linear import GEMV_MAX_ROWS, W8A16Linear

HAS_BF16 = bool(cpu_flags() & BF16_FLAGS)
PATHS = [
    "gemv",
    "fp16codes",
    "dequant",
    pytest.param("bf16", marks=pytest.mark.skipif(not HAS_BF16, reason="no bf16")),
]
# K = 80: torch's int8 GEMV on the bf16 path; K = 68, 70, 257: its fallback (see INT8PACK_K_MULTIPLE)
SHAPES = [(1, 45, 70), (2, 129, 257), (1, 64, 68), (1, 37, 80), (2, 37, 80), (7, 129, 257), (33, 64, 96)]


def _layer(n: int, k: int, bias: bool, path: str):
    g = torch.Generator().manual_seed(n * 1000 + k)
    q, s = quantize_per_token(torch.randn(n, k, generator=g))
    b = torch.randn(n, generator=g) if bias else None
    return W8A16Linear(q, s, b, path=path), q, s, b


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_every_path_matches_the_float64_reference(path: str, m: int, n: int, k: int, bias: bool) -> None:
    layer, q, s, b = _layer(n, k, bias, path)
    x = torch.randn(m, k) * torch.linspace(0.2, 4, k)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    b64 = 0 if b is None else b.double()
    if path == "bf16":
        sums = x.bfloat16().double() @ q.double().T
        bound = sums.abs() * 2**-8 * s.double() + 1e-5 * (sums.abs().max() * s.double().max())
        assert torch.all((y.double() - (sums * s.double() + b64)).abs() <= bound)
    else:
        ref = x.double() @ (q.double() * s.double()[:, None]).T + b64
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_gemv_above_its_rows_is_the_dequantised_gemm() -> None:
    """More than GEMV_MAX_ROWS rows run the very float32 GEMM of the `dequant` path."""
    gemv, *_ = _layer(96, 80, True, "gemv")
    dequant, *_ = _layer(96, 80, True, "dequant")
    x = torch.randn(GEMV_MAX_ROWS + 3, 80)
    assert torch.equal(gemv(x), dequant(x))


def test_batched_input_keeps_its_leading_dims() -> None:
    layer, q, s, _ = _layer(40, 72, False, "gemv")
    x = torch.randn(2, 1, 72)
    torch.testing.assert_close(layer(x), (x.double() @ (q.double() * s.double()[:, None]).T).float())


def test_a_failing_compile_falls_back_to_the_float_gemm(monkeypatch) -> None:
    def broken(*args):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpu_compile._State, "broken", None)
    monkeypatch.setattr(w8a16_cpu, "_compiled", lambda *key: broken)
    layer, *_ = _layer(30, 50, True, "gemv")
    reference, *_ = _layer(30, 50, True, "dequant")
    x = torch.randn(1, 50)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(layer(x), reference(x))
    assert any("compiled W8A16 GEMV failed" in str(w.message) for w in caught)
    assert not w8a16_cpu.compiler_available()


@pytest.mark.parametrize(
    ("flags", "compiler", "expected"),
    [
        (frozenset({"avx2", "avx512f", "avx512_bf16"}), True, "gemv"),  # bf16 only when forced
        (frozenset({"avx2", "avx512f"}), True, "gemv"),
        (frozenset({"avx2"}), True, "fp16codes"),  # AVX2 only: inductor's int8 loads are slow there
        (frozenset({"avx2"}), False, "fp16codes"),
        (frozenset({"avx2", "avx512f", "amx_bf16"}), False, "dequant"),
        (frozenset(), False, "dequant"),
    ],
)
def test_path_follows_the_cpu(monkeypatch, flags, compiler, expected) -> None:
    monkeypatch.delenv(W8A16_ENV_OVERRIDE, raising=False)
    assert choose_w8a16_path(flags, compiler) == expected


def test_env_override(monkeypatch) -> None:
    for path in ("gemv", "fp16codes", "dequant"):
        monkeypatch.setenv(W8A16_ENV_OVERRIDE, path)
        assert choose_w8a16_path(frozenset(), False) == path
    monkeypatch.setenv(W8A16_ENV_OVERRIDE, "bf16")
    assert choose_w8a16_path(frozenset({"avx512_bf16"}), True) == "bf16"
    with pytest.raises(TesselError, match="AVX-512 BF16"):
        choose_w8a16_path(frozenset({"avx2"}), True)
    monkeypatch.setenv(W8A16_ENV_OVERRIDE, "fp8")
    with pytest.raises(TesselError, match="TESSEL_W8A16_PATH"):
        choose_w8a16_path()
    with pytest.raises(TesselError, match="unknown W8A16 path"):
        _layer(8, 8, False, "fp8")


@pytest.mark.parametrize("path", ["gemv", "fp16codes", "dequant"])
def test_engine_decodes_like_hf_on_every_path(tiny_llama, tmp_path, monkeypatch, path: str) -> None:
    """Greedy decode (one row per step: the GEMV) of a W8A16 checkpoint: the engine's tokens and
    their logprobs equal HF's on the compressed-tensors model."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out = tmp_path / "w8a16"
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama), "--out", str(out), "--scheme", "w8a16"])
    assert result.exit_code == 0, result.output
    monkeypatch.setenv(W8A16_ENV_OVERRIDE, path)
    llm = LLM(out, max_model_len=64, block_size=8)
    assert {m.path for m in llm.model.modules() if isinstance(m, W8A16Linear)} == {path}
    prompt = torch.randint(4, 300, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))[0]
    hf = AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    ).eval()
    ids = torch.tensor([prompt + got.token_ids])
    with torch.no_grad():
        logprobs = hf(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    assert got.token_ids == logprobs.argmax(-1).tolist()
    chosen = logprobs.gather(1, torch.tensor(got.token_ids)[:, None])[:, 0]
    engine = torch.tensor([lp.logprob for lp in got.logprobs])
    torch.testing.assert_close(engine, chosen, atol=1e-4, rtol=1e-4)


def test_gemv_takes_strided_inputs_and_inference_mode() -> None:
    """The compiled GEMV runs without guards, so `gemv_int8` must hand it contiguous inputs:
    a strided row, a transposed weight view and float64 scales give the float64 reference."""
    g = torch.Generator().manual_seed(11)
    q, s = quantize_per_token(torch.randn(45, 70, generator=g))
    wide = torch.randn(1, 140, generator=g)
    x = wide[:, ::2]  # [1, 70], column stride 2
    q_view = q.t().contiguous().t()  # [45, 70] with strides (1, 45)
    want = x.double() @ (q.double() * s.double()[:, None]).T
    for inference in (False, True):
        with torch.inference_mode(inference):
            got = w8a16_cpu.gemv_int8(x, q_view, s.double())
        assert got is not None
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=150, deadline=None)
@given(
    row=st.lists(st.floats(-1e4, 1e4, width=32), min_size=70, max_size=70),
    ties=st.booleans(),
)
def test_compiled_row_quantiser_equals_quantize_per_token(row: list[float], ties: bool) -> None:
    """The compiled quantiser of a one-row W8A8 step: `quantize_per_token`'s codes and scales bit for
    bit, rounding ties included (values planted at (j + 1/2) * scale), and a row of zeros."""
    x = torch.tensor([row])
    if ties:
        scale = x.abs().max() / 127
        x[0, :10] = (torch.arange(10) - 5 + 0.5) * scale
    got = w8a16_cpu.quantize_rows(x)
    assert got is not None
    q, s = quantize_per_token(x)
    assert torch.equal(got[0], q.float()) and torch.equal(got[1], s)
