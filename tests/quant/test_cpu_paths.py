"""The CPU int8 paths of W8A8Linear give the same result, and the path follows the CPU's features.

Reference: float64 x @ W_deq.T with x quantised as the path quantises it. `int_mm` and `dequant`
compute the same integer products (int32 vs float32 sums, exact here), so they agree to float32
rounding, and `fp16codes` (fbgemm's float32 sums of the codes) equals `int_mm` bit for bit; `fbgemm`
quantises each row scaled to [-1, 1] with 7 bits, so it is held to its own bound (half a step of the
row's activation scale per element, summed against |W|).
"""

from __future__ import annotations

import pytest
import torch

from tessel.errors import TesselError
from tessel.kernels.quantize import quantize_per_token
from tessel.layers.quantized_linear import W8A8Linear
from tessel.quant import cpu_features
from tessel.quant.cpu_features import ENV_OVERRIDE, INT8_PATHS, choose_int8_path


def _layer(
    n: int, k: int, bias: bool, input_scale: float | None, path: str
) -> tuple[W8A8Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    q, s = quantize_per_token(w)
    b = torch.randn(n, generator=g) if bias else None
    scale = None if input_scale is None else torch.tensor([input_scale])
    return W8A8Linear(q, s, b, scale, path=path), q.double() * s.double()[:, None]


@pytest.mark.parametrize("path", INT8_PATHS)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 45, 70), (7, 129, 257), (33, 64, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_every_path_matches_the_float64_reference(path: str, m: int, n: int, k: int, bias: bool) -> None:
    layer, w_deq = _layer(n, k, bias, None, path)
    x = torch.randn(m, k) * torch.linspace(0.2, 4, k)
    y = layer(x)
    b = 0 if layer.bias is None else layer.bias.double()
    if path == "fbgemm":
        ref = x.double() @ w_deq.T + b
        absmax = x.double().abs().amax(1, keepdim=True)
        scaled = x.double() / absmax  # every row in [-1, 1], then one 7-bit step for them all
        step = (scaled.max().clamp(min=0) - scaled.min().clamp(max=0)) / 127 * absmax  # [M, 1]
        bound = (step / 2) * w_deq.abs().sum(dim=1) + 1e-4
        assert torch.all((y.double() - ref).abs() <= bound)
    else:
        q, s = quantize_per_token(x)
        ref = (q.double() * s.double()[:, None]) @ w_deq.T + b
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("input_scale", [0.01, 0.05])
def test_static_input_scale_on_every_path(input_scale: float) -> None:
    outputs = []
    for path in INT8_PATHS:
        layer, w_deq = _layer(40, 72, True, input_scale, path)
        x = torch.randn(9, 72)
        x[0, 3] = 100.0  # clipped at 127 steps
        outputs.append(layer(x))
        q = torch.round(x.double() / input_scale).clamp(-127, 127) * input_scale
        ref = q @ w_deq.T + layer.bias.double()
        torch.testing.assert_close(outputs[-1].double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert layer.path == "dequant"  # fbgemm's dynamic linear cannot take the static scale


def test_paths_agree_with_each_other_on_a_batch() -> None:
    x = torch.randn(32, 96)
    ys = {path: _layer(80, 96, True, None, path)[0](x) for path in INT8_PATHS}
    torch.testing.assert_close(ys["int_mm"], ys["dequant"], rtol=1e-5, atol=1e-4)
    assert torch.equal(ys["fp16codes"], ys["int_mm"])  # the same integer sums, the same epilogue
    one_row = {path: _layer(80, 96, True, None, path)[0](x[:1]) for path in ("fp16codes", "dequant")}
    torch.testing.assert_close(one_row["fp16codes"], one_row["dequant"], rtol=1e-6, atol=1e-6)
    rel = (ys["fbgemm"] - ys["int_mm"]).norm() / ys["int_mm"].norm()
    assert rel < 0.03


def test_fbgemm_quantises_each_row_on_its_own_scale() -> None:
    """A quiet row beside a loud one keeps its precision: per token, not per tensor."""
    layer, w_deq = _layer(64, 96, False, None, "fbgemm")
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(3))
    x[0] *= 1e3
    x[1] *= 1e-3
    ref = x.double() @ w_deq.T
    rel = (layer(x).double() - ref).norm(dim=1) / ref.norm(dim=1)
    assert torch.all(rel < 0.03), rel  # per tensor, the quiet row would round to zero (rel ~ 1)


@pytest.mark.parametrize(
    ("flags", "capability", "expected"),
    [
        ({"avx2", "avx512f", "avx512_vnni"}, "AVX512", "int_mm"),
        ({"avx2", "amx_int8", "amx_tile"}, "AVX512", "int_mm"),
        ({"avx2", "fma"}, "AVX2", "fp16codes"),
        ({"avx2", "avx512f"}, "AVX512", "fp16codes"),  # AVX-512 without VNNI: no fast _int_mm either
        ({"sse4_2"}, "DEFAULT", "dequant"),
        (set(), "DEFAULT", "dequant"),
    ],
)
def test_path_follows_the_cpu_features(monkeypatch, flags, capability, expected) -> None:
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    assert choose_int8_path(frozenset(flags), capability) == expected


def test_env_override_forces_a_path(monkeypatch) -> None:
    monkeypatch.setenv(ENV_OVERRIDE, "dequant")
    assert choose_int8_path(frozenset({"avx512_vnni"}), "AVX512") == "dequant"
    layer, _ = _layer(8, 16, False, None, None)  # type: ignore[arg-type]
    assert layer.path == "dequant"
    monkeypatch.setenv(ENV_OVERRIDE, "cuda")
    with pytest.raises(TesselError, match=ENV_OVERRIDE):
        choose_int8_path()


def test_this_machine_reads_its_flags() -> None:
    info = cpu_features.describe()
    assert info["int8_path"] in INT8_PATHS
    if "avx512_vnni" in cpu_features.cpu_flags():
        assert info["int8_path"] == "int_mm" or cpu_features.os.environ.get(ENV_OVERRIDE)


@pytest.mark.parametrize(("n", "k"), [(45, 70), (129, 257), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("input_scale", [None, 0.02])
def test_one_row_gemv_equals_the_int32_gemm(monkeypatch, n: int, k: int, bias: bool, input_scale) -> None:
    """A single row takes the compiled GEMV (float32 sums of the integer products): bit for bit the
    int32 GEMM + epilogue of `int8_gemm` (its sums stay below 2**24 here), also without a compiler."""
    from tessel.kernels import cpu_compile
    from tessel.kernels.int8_gemm import int8_gemm

    layer, _ = _layer(n, k, bias, input_scale, "int_mm")
    x = torch.randn(1, k) * torch.linspace(0.2, 4, k)
    q, s = layer._quantize_input(x)
    want = int8_gemm(q, layer.weight, s, layer.weight_scale, layer.bias, out_dtype=torch.float32)
    assert layer._gemv(x) is not None
    assert torch.equal(layer(x), want)
    with torch.inference_mode():
        assert torch.equal(layer(x[None]), want[None])  # [1, 1, K]: leading dims kept
    monkeypatch.setattr(cpu_compile._State, "broken", "no compiler (test)")
    assert layer._gemv(x) is None
    assert torch.equal(layer(x), want)


def _narrow_layer(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weight codes in [-63, 63] (`--weight-code-bits 7`) and their scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    s = w.abs().amax(1) / 63
    return torch.round(w / s[:, None]).clamp(-63, 63).to(torch.int8), s


@pytest.fixture
def avx2_cpu(monkeypatch):
    """This process seen as an AVX2 CPU without VNNI (the path choice only; every path runs anywhere)."""
    if not cpu_features.fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma", "f16c"}))


@pytest.mark.parametrize(("m", "n", "k"), [(1, 45, 70), (7, 129, 257), (33, 64, 96)])
def test_7bit_weight_codes_take_fbgemm_with_8bit_activations_on_avx2(avx2_cpu, m, n, k) -> None:
    """Weights in [-64, 63] cannot saturate AVX2's int16 pair sums against 8-bit activation codes:
    the layer picks fbgemm with 255 levels per row, held to half of that step against float64."""
    q, s = _narrow_layer(n, k, m)
    layer = W8A8Linear(q, s, torch.randn(n))
    assert (layer.path, layer._fbgemm_act_bits) == ("fbgemm", 8)
    x = torch.randn(m, k) * torch.linspace(0.2, 4, k)
    x[0, 5] = 40.0  # an outlier in the first row only
    w_deq = q.double() * s.double()[:, None]
    ref = x.double() @ w_deq.T + layer.bias.double()
    absmax = x.double().abs().amax(1, keepdim=True)
    scaled = x.double() / absmax  # every row in [-1, 1], then one 8-bit step for them all
    step = (scaled.max().clamp(min=0) - scaled.min().clamp(max=0)) / 255 * absmax  # [M, 1]
    bound = (step / 2) * w_deq.abs().sum(dim=1) + 1e-4
    assert torch.all((layer(x).double() - ref).abs() <= bound)
    # and tighter than the int8 per-token codes of the exact paths would be held to (absmax / 127)
    exact = W8A8Linear(q, s, layer.bias, path="dequant")(x).double()
    assert (layer(x).double() - ref).norm() < 1.5 * (exact - ref).norm()


def test_full_range_weights_keep_fp16codes_or_7bit_activations(avx2_cpu) -> None:
    layer, _ = _layer(64, 96, False, None, None)  # type: ignore[arg-type]
    assert int(layer.weight.abs().max()) == 127
    assert (layer.path, layer._fbgemm_act_bits) == ("fp16codes", 7)
    layer.set_path("fbgemm")  # opt-in: 7-bit activation codes, never 8 against these weights
    assert layer._fbgemm_act_bits == 7
    q, s = _narrow_layer(64, 96, 1)
    static = W8A8Linear(q, s, input_scale=torch.tensor([0.02]))  # fbgemm takes no static scale
    assert static.path == "fp16codes"


@pytest.mark.parametrize(
    ("flags", "capability", "expected"),
    [
        ({"avx2", "avx512f", "avx512_vnni"}, "AVX512", "int_mm"),  # VNNI sums never saturate: int_mm
        ({"avx2", "fma"}, "AVX2", "fbgemm"),
        ({"avx2", "avx512f"}, "AVX512", "fbgemm"),
        (set(), "DEFAULT", "dequant"),
    ],
)
def test_7bit_weights_path_follows_the_cpu_features(monkeypatch, flags, capability, expected) -> None:
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    if expected == "fbgemm" and not cpu_features.fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    assert choose_int8_path(frozenset(flags), capability, weights_fit_7bit=True) == expected
    monkeypatch.setenv(ENV_OVERRIDE, "fp16codes")  # a forced path still wins
    assert choose_int8_path(frozenset(flags), capability, weights_fit_7bit=True) == "fp16codes"


def test_fits_7bit_codes_edges() -> None:
    from tessel.kernels.int8_cpu import fbgemm_linear, fbgemm_pack, fits_7bit_codes

    assert fits_7bit_codes(torch.tensor([[-64, 63]], dtype=torch.int8))
    assert not fits_7bit_codes(torch.tensor([[-65, 0]], dtype=torch.int8))
    assert not fits_7bit_codes(torch.tensor([[0, 64]], dtype=torch.int8))
    assert fits_7bit_codes(torch.zeros(0, 4, dtype=torch.int8))
    packed = fbgemm_pack(torch.ones(2, 4, dtype=torch.int8), torch.ones(2))
    with pytest.raises(ValueError, match="7 or 8 bits"):
        fbgemm_linear(torch.ones(1, 4), packed, None, act_bits=6)
