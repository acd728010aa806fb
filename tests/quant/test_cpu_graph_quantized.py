"""Quantised checkpoints through the compiled CPU decode step (`tessel.engine.cpu_graph`), each linear
module's traced one-row form (`layer.one_row_form()`) and its split multi-row form (`layer.split()`,
`tessel.layers.linear.forms`).

Oracles: HF transformers + compressed-tensors (`ct_oracle.hf_quantized`, activations fake-quantised
as the int8 GEMM computes them) for the decode steps' logits; each module's own eager forward for
its traced form.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from ct_oracle import hf_quantized
from decode_steps import batch_decode_logits, decode_logits
from tessel import LLM
from tessel.cli import app
from tessel.engine.cpu_graph import CpuGraph
from tessel.kernels import cpu_compile, decode_row, int8_gemv
from tessel.kernels.cpu_features import ENV_OVERRIDE as INT8_ENV_OVERRIDE
from tessel.kernels.cpu_features import W8A16_ENV_OVERRIDE, avx512_cpu, cpu_flags, fbgemm_act_bits
from tessel.layers.linear import W8A8Linear, W8A16Linear, linear_form, split_linear

pytestmark = pytest.mark.skipif(not cpu_compile.compiler_available(), reason="no C++ compiler for inductor")

CALIB = ["--calib-samples", "4", "--seq-len", "32"]
SCHEMES = {
    "w8a8": ["--scheme", "w8a8"],
    "w8a8-static": ["--scheme", "w8a8", "--act", "static"],
    "w8a16": ["--scheme", "w8a16"],
}


@pytest.fixture(scope="module")
def quantized(tiny_llama, calib_text, tmp_path_factory):
    """quantized(name) -> the tiny Llama quantised with SCHEMES[name] (written once per module)."""
    root = tmp_path_factory.mktemp("quantized")
    done = {}

    def get(name: str):
        if name not in done:
            out = root / name
            args = ["quantize", str(tiny_llama), "--out", str(out), *CALIB, "--calib", str(calib_text)]
            result = CliRunner().invoke(app, [*args, *SCHEMES[name]])
            assert result.exit_code == 0, result.output
            done[name] = out
        return done[name]

    return get


@pytest.mark.parametrize(
    ("scheme", "path"),
    [("w8a8", None), ("w8a8", "int_mm"), ("w8a8", "dequant"), ("w8a8-static", None), ("w8a16", None)],
)
def test_decode_steps_match_the_compressed_tensors_oracle(quantized, monkeypatch, scheme, path) -> None:
    """None: the path this CPU picks (on AVX2 W8A8's fbgemm and W8A16's fp16codes have no traced
    form, so the test forces the compiled GEMV path there)."""
    out = quantized(scheme)
    if path is not None:
        monkeypatch.setenv(INT8_ENV_OVERRIDE, path)
    llm = LLM(out, max_model_len=128, block_size=8)
    if llm.runner.cpu_graph is None or not llm.runner.cpu_graph.row_forms:
        assert path is None and not avx512_cpu()
        monkeypatch.setenv(INT8_ENV_OVERRIDE, "dequant")
        monkeypatch.setenv(W8A16_ENV_OVERRIDE, "gemv")
        llm = LLM(out, max_model_len=128, block_size=8)
    # W8A8: an activation on a rounding tie may round the other way (the graph sums in its own order)
    _assert_one_row_steps_match(llm, out, tol=2e-3 if "w8a8" in scheme else 1e-4)


def _assert_one_row_steps_match(llm: LLM, checkpoint, tol: float) -> None:
    """34 one-row decode steps, all through the compiled graph, give the oracle's logits."""
    ids = torch.randint(4, 300, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    got, graph_steps = decode_logits(llm, ids, prefill=6)
    assert graph_steps == 34
    with torch.no_grad():
        expected = hf_quantized(checkpoint)(torch.tensor([ids])).logits[0]
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("isa", int8_gemv.ISAS)
@pytest.mark.parametrize("path", ["fbgemm", "fp16codes"])
def test_one_row_steps_call_the_int8_gemv(quantized, monkeypatch, isa, path) -> None:
    """W8A8 whose GEMM reads per-token codes: the one-row step's graphs call tessel's int8 GEMV for
    every linear (the kernel forced, where this CPU runs it)."""
    if not int8_gemv.NEEDS[isa] <= cpu_flags() or not int8_gemv.available():
        pytest.skip(f"this CPU or machine cannot run the {isa} kernel")
    if path == "fbgemm" and fbgemm_act_bits(False) != 8:
        pytest.skip("fbgemm multiplies 8-bit activation codes by full-range weights only with VNNI")
    monkeypatch.setenv(INT8_ENV_OVERRIDE, path)
    monkeypatch.setenv(int8_gemv.ENV_OVERRIDE, isa)
    out = quantized("w8a8")
    llm = LLM(out, max_model_len=128, block_size=8)
    linears = [m for m in llm.runner.model.modules() if isinstance(m, W8A8Linear)]
    assert {m.plan.row_kernel.isa for m in linears} == {isa}
    assert {linear_form(m).kind for m in linears} == {"w8a8_int8_gemv"} and llm.runner.cpu_graph.row_forms
    _assert_one_row_steps_match(llm, out, tol=2e-3)  # near-tie codes, as above


@pytest.mark.parametrize("native", ["on", "off"])
def test_a_qwen3_w8a8_checkpoint_takes_the_one_row_step(calib_text, tmp_path, monkeypatch, native) -> None:
    """Qwen3's q/k norms inside the one-row step: the native operator (on) or the compiled graphs
    (off), three layers so that the layers between the first and the last share their graphs."""
    import tiny_models

    monkeypatch.setenv(decode_row.ENV_OVERRIDE, native)
    qwen3 = tiny_models.make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", seed=4, num_hidden_layers=3)
    out = tmp_path / "w8a8"
    args = ["quantize", str(qwen3), "--out", str(out), *CALIB, "--calib", str(calib_text), *SCHEMES["w8a8"]]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    llm = LLM(out, max_model_len=128, block_size=8)
    graph = llm.runner.cpu_graph
    if graph is None or not graph.row_forms:
        pytest.skip("no one-row traced forms for W8A8 here (no int8 GEMV kernel)")
    assert (graph.native_row is not None) == (native == "on" and decode_row.available())
    _assert_one_row_steps_match(llm, out, tol=2e-3)  # near-tie codes, as above


def _modules(with_bias: bool) -> list[torch.nn.Module]:
    g = torch.Generator().manual_seed(6)
    n, k = 48, 80
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) / 100 + 1e-3
    bias = torch.randn(n, generator=g) if with_bias else None
    linear = torch.nn.Linear(k, n, bias=with_bias)
    return [
        W8A8Linear(w, scale, bias, path="int_mm"),
        W8A8Linear(w, scale, bias, input_scale=torch.tensor(0.02), path="int_mm"),
        W8A8Linear(w, scale, bias, path="dequant"),
        W8A16Linear(w, scale, bias, path="gemv"),
        linear.requires_grad_(False),
    ]


@pytest.mark.parametrize("with_bias", [False, True])
def test_each_traced_form_computes_its_modules_one_row_forward(with_bias: bool) -> None:
    x = torch.randn(1, 80, generator=torch.Generator().manual_seed(7)) * 3
    for module in _modules(with_bias):
        form = linear_form(module)
        assert form is not None, module
        got, kept = form.apply(x, form.inputs)
        expected = module(x)
        # the same formula, summed in another order by eager torch than by the compiled GEMV
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
        inputs = [x, *form.inputs]
        compiled = cpu_compile.compile_graph(lambda x, *ins, f=form: (f.apply(x, list(ins))[0],), inputs)
        torch.testing.assert_close(compiled(*inputs)[0], expected, rtol=1e-5, atol=1e-5)
        assert kept[0] is x


def test_paths_without_a_traced_form_keep_the_model_eager(quantized, monkeypatch) -> None:
    monkeypatch.setenv(int8_gemv.ENV_OVERRIDE, "off")  # W8A8 on fp16codes: no one-row form without it
    w = torch.randint(-63, 64, (16, 32), dtype=torch.int8)
    assert linear_form(W8A16Linear(w, torch.ones(16), path="dequant")) is None
    assert linear_form(W8A16Linear(w, torch.ones(16), path="fp16codes")) is None
    assert linear_form(W8A8Linear(w, torch.ones(16), path="fp16codes")) is None
    llm = LLM(quantized("w8a16"), max_model_len=64)
    layer = llm.runner.model.model.layers[1].mlp
    layer.down_proj.set_path("dequant")
    assert not CpuGraph.for_model(llm.runner.model, all_rows=True).row_forms


SPLIT_KINDS = {"fbgemm": "fbgemm8", "fp16codes": "fp16codes"}  # W8A8 paths whose GEMM is split out


@pytest.mark.parametrize(
    ("scheme", "path"), [("w8a8", "fbgemm"), ("w8a8", "fp16codes"), ("w8a8", "int_mm"), ("w8a16", None)]
)
def test_batch_decode_steps_match_the_compressed_tensors_oracle(quantized, monkeypatch, scheme, path) -> None:
    """fbgemm, fp16codes: the quantiser and epilogue inside the graphs (fbgemm's 8-bit codes only where
    they cannot saturate, AVX-512 VNNI; the tiny model's weights are not 7-bit elsewhere); int_mm,
    W8A16: whole modules called between the graphs."""
    if path == "fbgemm" and fbgemm_act_bits(False) != 8:
        pytest.skip("fbgemm multiplies 8-bit activation codes by full-range weights only with VNNI")
    if path is not None:
        monkeypatch.setenv(INT8_ENV_OVERRIDE, path)
    out = quantized(scheme)
    llm = LLM(out, max_model_len=128, block_size=8)
    linears = [m for m in llm.runner.model.modules() if isinstance(m, W8A8Linear | W8A16Linear)]
    kinds = {split_linear(m).kind for m in linears}
    assert kinds == {SPLIT_KINDS.get(path, "opaque")}
    # whole modules only: the engine leaves the steps of several rows eager (not worth compiling);
    # a graph taking them is installed here
    graph = llm.runner.cpu_graph
    assert (graph is not None and graph.takes(5)) == (kinds != {"opaque"})
    if kinds == {"opaque"}:
        llm.runner.cpu_graph = CpuGraph.for_model(llm.runner.model, all_rows=True)
    prompts = torch.randint(4, 300, (5, 30), generator=torch.Generator().manual_seed(8)).tolist()
    got, graph_steps = batch_decode_logits(llm, prompts, prefill=6)
    assert graph_steps == 24
    with torch.no_grad():
        expected = hf_quantized(out)(torch.tensor(prompts)).logits[:, 6:].transpose(0, 1)
    scale = float(expected.abs().max())
    tol = 2e-3 if "w8a8" in scheme else 1e-4  # W8A8: near-tie activations, as above
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [2, 7, 32])
def test_each_split_form_computes_its_modules_forward(with_bias: bool, rows: int) -> None:
    """post(call(pre(x))) run eagerly: the module's own ops in the same order, so the same bits."""
    x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(rows)) * 3
    modules = _modules(with_bias)
    w, scale = modules[0].weight, modules[0].weight_scale
    bias = modules[0].bias
    modules.append(W8A8Linear(w, scale, bias, path="fp16codes"))
    if fbgemm_act_bits(False) == 8:
        modules.append(W8A8Linear(w, scale, bias, path="fbgemm"))
    for module in modules:
        split = split_linear(module)
        dynamic = getattr(module, "input_scale", 0) is None
        assert split.kind == (SPLIT_KINDS.get(module.path, "opaque") if dynamic else "opaque")
        inputs, carried = split.pre(x)
        assert len(carried) == split.num_carried
        got = split.post(split.call(inputs), carried, list(split.weights))
        torch.testing.assert_close(got, module(x), rtol=0, atol=0)
