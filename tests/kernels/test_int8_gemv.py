"""tessel's one-row int8 GEMV (`tessel.kernels.int8_gemv`): exact integer sums against int64 matmul,
on each kernel this CPU can run, and the W8A8 layer that takes it."""

from __future__ import annotations

import warnings

import pytest
import torch

from tessel.errors import TesselError
from tessel.kernels import cpu_compile, cpu_features, int8_gemv, native_build
from tessel.kernels.int8_gemm import int8_epilogue
from tessel.kernels.quantize_rows import quantize_per_token
from tessel.layers.linear import W8A8Linear


def _runnable(isa: str) -> bool:
    return int8_gemv.NEEDS[isa] <= cpu_features.cpu_flags() and int8_gemv.available()


def _isas() -> list:
    return [
        pytest.param(isa, marks=pytest.mark.skipif(not _runnable(isa), reason=f"no {isa} here"))
        for isa in int8_gemv.ISAS
    ]


def _oracle(codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The exact integer sums, converted to float32 once (as the int32 GEMM's are)."""
    return (codes.to(torch.int64) @ weight.to(torch.int64).t()).to(torch.float32)


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize(
    ("n", "k"),
    # one weight, blocks' tails in rows and columns, SmolLM2's shapes, codes past the stack buffer
    [(1, 1), (5, 3), (17, 65), (31, 100), (960, 576), (576, 1536), (3, 9000)],
)
def test_sums_are_the_exact_integer_products(isa: str, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 7919 + k)
    low = -127 if isa == "avx2" else -128  # avx2 does not take a weight of -128
    weight = torch.randint(low, 128, (n, k), generator=g, dtype=torch.int8)
    codes = torch.randint(-127, 128, (1, k), generator=g).float()
    got = int8_gemv.gemv_sums(codes, int8_gemv.pack(weight, isa))
    assert got.shape == (1, n) and got.dtype == torch.float32
    assert torch.equal(got, _oracle(codes, weight))


@pytest.mark.parametrize("isa", _isas())
def test_extreme_codes_do_not_saturate(isa: str) -> None:
    """|codes| 127 times |weights| 127 (128 with VNNI): AVX2's pairs of products stay in int16, the
    sums past 2**24 are the int32 ones rounded once."""
    k = 4096
    weight = torch.full((20, k), -128 if isa == "vnni" else -127, dtype=torch.int8)
    weight[1::2] = 127
    codes = torch.full((1, k), -127.0)
    codes[0, ::3] = 127.0
    got = int8_gemv.gemv_sums(codes, int8_gemv.pack(weight, isa))
    assert torch.equal(got, _oracle(codes, weight))


def test_avx2_refuses_a_weight_of_minus_128() -> None:
    if not _runnable("avx2"):
        pytest.skip("no avx2 here")
    weight = torch.zeros(4, 64, dtype=torch.int8)
    assert int8_gemv.pack(weight, "avx2") is not None
    weight[2, 5] = -128
    assert int8_gemv.pack(weight, "avx2") is None


def test_the_kernel_follows_the_cpu_and_the_override(monkeypatch) -> None:
    monkeypatch.delenv(int8_gemv.ENV_OVERRIDE, raising=False)
    vnni = frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"})
    assert int8_gemv.choose_gemv_isa(vnni) == "vnni"
    assert int8_gemv.choose_gemv_isa(frozenset({"avx2", "avx512f", "avx512_vnni"})) == "avx2"  # no BW
    assert int8_gemv.choose_gemv_isa(frozenset({"avx2", "fma"})) == "avx2"
    assert int8_gemv.choose_gemv_isa(frozenset({"sse4_2"})) is None
    monkeypatch.setenv(int8_gemv.ENV_OVERRIDE, "off")
    assert int8_gemv.choose_gemv_isa(vnni) is None
    monkeypatch.setenv(int8_gemv.ENV_OVERRIDE, "avx2")
    assert int8_gemv.choose_gemv_isa(vnni) == "avx2"
    monkeypatch.setenv(int8_gemv.ENV_OVERRIDE, "neon")
    with pytest.raises(TesselError, match="TESSEL_INT8_GEMV"):
        int8_gemv.choose_gemv_isa(vnni)


def test_wrong_codes_are_refused() -> None:
    isa = next((i for i in int8_gemv.ISAS if _runnable(i)), None)
    if isa is None:
        pytest.skip("no int8 GEMV kernel here")
    packed = int8_gemv.pack(torch.ones(8, 32, dtype=torch.int8), isa)
    with pytest.raises(TesselError, match=r"float32 codes \[1, 32\]"):
        int8_gemv.gemv_sums(torch.ones(2, 32), packed)


def test_built_into_the_cache_and_a_failed_build_falls_back(monkeypatch, tmp_path) -> None:
    """The operator is compiled into $TESSEL_CACHE_DIR/native and nothing else is left there; a
    compiler that fails warns once and the layer keeps its GEMM."""
    compiler = native_build.cxx_compiler()
    if compiler is None:
        pytest.skip("no C++ compiler here")
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path))
    built = int8_gemv.build(compiler)
    assert built.parent == tmp_path / "native" and list(built.parent.iterdir()) == [built]
    assert int8_gemv.build(compiler) == built  # found, not compiled again
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path / "other"))
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    monkeypatch.setattr(int8_gemv, "_registered", lambda: False)
    int8_gemv.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="building the int8 GEMV failed"):
            assert not int8_gemv.available()
        assert list((tmp_path / "other" / "native").iterdir()) == []  # the staging file removed
        layer = W8A8Linear(torch.ones(8, 32, dtype=torch.int8), torch.ones(8), path="fbgemm")
        assert layer.plan.row_kernel is None and layer.one_row_form().kind != "w8a8_int8_gemv"
    finally:
        int8_gemv.available.cache_clear()


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 weight codes [n, k], their scales and a bias."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return weight, torch.rand(n, generator=g) / 100 + 1e-3, torch.randn(n, generator=g)


def _assert_the_int32_gemm(layer: W8A8Linear, x: torch.Tensor) -> None:
    """`layer(x)`: the exact integer sums of `quantize_per_token`'s codes, then `int8_epilogue`."""
    codes, scale = quantize_per_token(x)
    sums = (codes.to(torch.int64) @ layer.weight.to(torch.int64).t()).to(torch.float32)
    assert torch.equal(layer(x), int8_epilogue(sums, scale, layer.weight_scale, layer.bias, torch.float32))


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("path", ["fbgemm", "fp16codes"])
def test_a_w8a8_row_takes_the_kernel_eagerly_and_traced(monkeypatch, isa: str, path: str) -> None:
    """One row of a W8A8 layer whose GEMM reads per-token codes takes the kernel: the int32 GEMM's
    numbers, eagerly and as its traced one-row form (compiled by inductor, the operator inside)."""
    if not cpu_features.fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    monkeypatch.setenv(int8_gemv.ENV_OVERRIDE, isa)
    layer = W8A8Linear(*_weights(70, 200, 3), path=path)
    assert layer.plan.row_kernel is not None and layer.plan.row_kernel.isa == isa
    assert not layer.plan.one_row_gemv and layer.split().kind in ("fbgemm8", "fp16codes")
    calls = []
    real = int8_gemv.gemv_sums
    monkeypatch.setattr(
        "tessel.layers.linear.w8a8.int8_gemv_sums", lambda c, w: calls.append(1) or real(c, w)
    )
    x = torch.randn(1, 200) * 3
    _assert_the_int32_gemm(layer, x)
    _assert_the_int32_gemm(layer, torch.randn(5, 200))  # more rows: the GEMM
    assert calls == [1]
    form = layer.one_row_form()
    assert form.kind == "w8a8_int8_gemv"
    inputs = [x, *form.inputs]
    compiled = cpu_compile.compile_graph(lambda x, *ins: (form.apply(x, list(ins))[0],), inputs)
    expected = layer(x)  # the graph may fuse the bias into a multiply-add: to float32 rounding
    torch.testing.assert_close(
        compiled(*inputs)[0], expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max())
    )


def test_static_scales_and_the_override_keep_the_other_paths(monkeypatch) -> None:
    weight, scale, _ = _weights(40, 64, 5)
    monkeypatch.setenv(int8_gemv.ENV_OVERRIDE, "off")
    assert W8A8Linear(weight, scale, path="fbgemm").plan.row_kernel is None
    monkeypatch.delenv(int8_gemv.ENV_OVERRIDE)
    static = W8A8Linear(weight, scale, input_scale=torch.tensor(0.02), path="fbgemm")
    assert static.plan.row_kernel is None  # its codes are not per token: no split form either
    for path in ("int_mm", "dequant"):  # their GEMMs do not read codes: inductor's GEMV keeps the row
        assert W8A8Linear(weight, scale, path=path).plan.row_kernel is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default path is chosen without a warning
        W8A8Linear(weight, scale)
