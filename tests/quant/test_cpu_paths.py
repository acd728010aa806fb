"""The CPU int8 paths of W8A8Linear give the same result, and the path follows the CPU's features.

Reference: float64 x @ W_deq.T with x quantised as the path quantises it. `int_mm` and `dequant`
compute the same integer products (int32 vs float32 sums, exact here), so they agree to float32
rounding, and `fp16codes` (fbgemm's float32 sums of the codes) equals `int_mm` bit for bit, as does
`fbgemm` with 8-bit activation codes (AVX-512 VNNI, or 7-bit weight codes); with 7-bit codes it
quantises each row scaled to [-1, 1], so it is held to its own bound (half a step of the row's
activation scale per element, summed against |W|).
"""

from __future__ import annotations

import pytest
import torch

from tessel.errors import TesselError
from tessel.kernels import cpu_features
from tessel.kernels.cpu_features import ENV_OVERRIDE, INT8_PATHS, choose_int8_path
from tessel.kernels.quantize_rows import quantize_per_token
from tessel.layers.linear import W8A8Linear


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
    if path == "fbgemm" and layer.plan.fbgemm_act_bits == 7:  # 8 bits: quantize_per_token's codes
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
    if _layer(80, 96, True, None, "fbgemm")[0].plan.fbgemm_act_bits == 8:  # VNNI: the same codes
        assert torch.equal(ys["fbgemm"], ys["int_mm"])
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
        ({"avx2", "avx512f", "avx512_vnni"}, "AVX512", "fbgemm"),  # VNNI: fbgemm's sums cannot saturate
        ({"avx2", "amx_int8", "amx_tile"}, "AVX512", "int_mm"),
        ({"avx2", "avx512_vnni", "amx_int8", "amx_tile"}, "AVX512", "int_mm"),  # AMX: oneDNN's tiles
        ({"avx2", "fma"}, "AVX2", "fp16codes"),
        ({"avx2", "avx512f"}, "AVX512", "fp16codes"),  # AVX-512 without VNNI: no fast _int_mm either
        ({"sse4_2"}, "DEFAULT", "dequant"),
        (set(), "DEFAULT", "dequant"),
    ],
)
def test_path_follows_the_cpu_features(monkeypatch, flags, capability, expected) -> None:
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    if expected == "fbgemm" and not cpu_features.fbgemm_available():
        expected = "int_mm"
    assert choose_int8_path(frozenset(flags), capability) == expected


def test_static_scales_keep_int_mm_on_vnni(monkeypatch) -> None:
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    vnni = frozenset({"avx2", "avx512f", "avx512_vnni"})
    assert choose_int8_path(vnni, "AVX512", static_scales=True) == "int_mm"
    assert choose_int8_path(frozenset({"avx2"}), "AVX2", weights_fit_7bit=True, static_scales=True) == (
        "fp16codes" if cpu_features.fbgemm_available() else "dequant"
    )


@pytest.mark.parametrize(
    ("flags", "narrow", "bits"),
    [({"avx2"}, False, 7), ({"avx2"}, True, 8), ({"avx512f"}, False, 7), ({"avx512_vnni"}, False, 8)],
)
def test_fbgemm_activation_bits_follow_the_saturation_rule(flags, narrow, bits) -> None:
    assert cpu_features.fbgemm_act_bits(narrow, frozenset(flags)) == bits


def _fbgemm_worst_case(k: int) -> tuple[float, float]:
    """fbgemm's dynamic linear on activations that all code to 255 against weight codes of 127: the
    pair sums of AVX2's vpmaddubsw (2 x 255 x 127) pass int16's 32767. -> (got, exact)."""
    from tessel.kernels.int8_cpu import fbgemm_linear, fbgemm_pack

    packed = fbgemm_pack(torch.full((4, k), 127, dtype=torch.int8), torch.ones(4))
    got = fbgemm_linear(torch.ones(1, k), packed, None, act_bits=8)[0, 0].item()
    return got, 127.0 * k


def test_fbgemm_saturates_exactly_where_the_rule_says() -> None:
    """The rule behind `fbgemm_act_bits`, checked on this machine's fbgemm: full-range 8-bit codes are
    exact on AVX-512 VNNI and saturate without it."""
    if not cpu_features.fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    got, exact = _fbgemm_worst_case(576)
    if cpu_features.FBGEMM_NO_SATURATION_FLAG in cpu_features.cpu_flags():
        assert got == pytest.approx(exact, rel=1e-6)
    else:
        assert got < 0.6 * exact  # int16 pair sums: each pair capped at 32767 of 64770


def _assert_per_token_int8(layer: W8A8Linear, x: torch.Tensor) -> None:
    """`layer(x)` is the int32 GEMM of `quantize_per_token`'s codes: against float64 to float32
    rounding, and bit for bit `int8_gemm`'s result."""
    from tessel.kernels.int8_gemm import int8_gemm

    q, s = quantize_per_token(x)
    w_deq = layer.weight.double() * layer.weight_scale.double()[:, None]
    ref = (q.double() * s.double()[:, None]) @ w_deq.T + layer.bias.double()
    got = layer(x)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    # and bit for bit the int32 GEMM path's result (integer sums, then the same epilogue)
    assert torch.equal(got, int8_gemm(q, layer.weight, s, layer.weight_scale, layer.bias, torch.float32))


@pytest.mark.parametrize(("m", "n", "k"), [(1, 45, 70), (7, 129, 257), (32, 576, 1536)])
def test_full_range_weights_take_8bit_fbgemm_on_vnni(monkeypatch, m, n, k) -> None:
    """On an AVX-512 VNNI CPU a full-range W8A8 layer runs fbgemm on the per-token int8 codes and
    computes what the int32 GEMM does: worst-case codes (255 against 127) included."""
    if cpu_features.FBGEMM_NO_SATURATION_FLAG not in cpu_features.cpu_flags():
        pytest.skip("needs a CPU with AVX-512 VNNI (fbgemm's 8-bit codes saturate elsewhere)")
    if not cpu_features.fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    amx = cpu_features.AMX_INT8_FLAG in cpu_features.cpu_flags()  # the default is int_mm there: forced
    layer, _ = _layer(n, k, True, None, "fbgemm" if amx else None)  # type: ignore[arg-type]
    assert int(layer.weight.abs().max()) == 127
    assert (layer.path, layer.plan.fbgemm_act_bits) == ("fbgemm", 8)
    x = torch.randn(m, k) * torch.linspace(0.2, 4, k)
    x[0, 5] = 40.0
    _assert_per_token_int8(layer, x)
    worst = W8A8Linear(torch.full((n, k), 127, dtype=torch.int8), torch.full((n,), 1e-3), torch.zeros(n))
    _assert_per_token_int8(worst, torch.ones(m, k))  # every code 127 (+128: 255) against 127


def test_env_override_forces_a_path(monkeypatch) -> None:
    monkeypatch.setenv(ENV_OVERRIDE, "dequant")
    assert choose_int8_path(frozenset({"avx512_vnni"}), "AVX512") == "dequant"
    layer, _ = _layer(8, 16, False, None, None)  # type: ignore[arg-type]
    assert layer.path == "dequant"
    monkeypatch.setenv(ENV_OVERRIDE, "cuda")
    with pytest.raises(TesselError, match=ENV_OVERRIDE):
        choose_int8_path()


def test_this_machine_reads_its_flags() -> None:
    info = cpu_features.cpu_summary()
    assert info["int8_path"] in INT8_PATHS
    if "avx512_vnni" in cpu_features.cpu_flags() and not cpu_features.os.environ.get(ENV_OVERRIDE):
        amx = "amx_int8" in cpu_features.cpu_flags() or not cpu_features.fbgemm_available()
        assert info["int8_path"] == ("int_mm" if amx else "fbgemm")


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
    the layer picks fbgemm on the per-token int8 codes, the int32 GEMM's result."""
    q, s = _narrow_layer(n, k, m)
    layer = W8A8Linear(q, s, torch.randn(n))
    assert (layer.path, layer.plan.fbgemm_act_bits) == ("fbgemm", 8)
    x = torch.randn(m, k) * torch.linspace(0.2, 4, k)
    x[0, 5] = 40.0  # an outlier in the first row only
    _assert_per_token_int8(layer, x)
    codes_63 = torch.full((n, k), 63, dtype=torch.int8)
    narrow_worst = W8A8Linear(codes_63, torch.full((n,), 1e-3), torch.zeros(n))
    _assert_per_token_int8(narrow_worst, torch.ones(m, k))  # codes 255 against 63: 32130 < 2**15


def test_full_range_weights_keep_fp16codes_or_7bit_activations(avx2_cpu) -> None:
    layer, _ = _layer(64, 96, False, None, None)  # type: ignore[arg-type]
    assert int(layer.weight.abs().max()) == 127
    assert (layer.path, layer.plan.fbgemm_act_bits) == ("fp16codes", 7)
    layer.set_path("fbgemm")  # opt-in: 7-bit activation codes, never 8 against these weights
    assert layer.plan.fbgemm_act_bits == 7
    q, s = _narrow_layer(64, 96, 1)
    static = W8A8Linear(q, s, input_scale=torch.tensor([0.02]))  # fbgemm takes no static scale
    assert static.path == "fp16codes"


@pytest.mark.parametrize(
    ("flags", "capability", "expected"),
    [
        ({"avx2", "avx512f", "avx512_vnni"}, "AVX512", "fbgemm"),  # VNNI sums never saturate
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


@pytest.mark.parametrize(
    ("flags", "gemv"),
    [({"avx2", "avx512f", "avx512_vnni"}, True), ({"avx", "avx2", "fma", "f16c"}, False)],
)
def test_one_fbgemm_row_takes_the_gemv_only_with_avx512(monkeypatch, flags, gemv) -> None:
    """Without tessel's int8 GEMV, a single row on the fbgemm path runs inductor's GEMV where it is
    fast (AVX-512), on the same per-token codes, so the result is the int32 GEMM's either way."""
    if not cpu_features.fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    monkeypatch.setenv("TESSEL_INT8_GEMV", "off")
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    q, s = _narrow_layer(96, 160, 4)  # 7-bit codes: 8-bit activations on either CPU
    layer = W8A8Linear(q, s, torch.randn(96))
    assert (layer.path, layer.plan.fbgemm_act_bits, layer.plan.one_row_gemv) == ("fbgemm", 8, gemv)
    calls = []
    monkeypatch.setattr(layer, "_gemv", lambda rows: calls.append(rows) or None)  # falls through
    _assert_per_token_int8(layer, torch.randn(1, 160) * 3)
    assert len(calls) == (1 if gemv else 0)


def test_fbgemm_codes_round_near_ties_as_quantize_per_token() -> None:
    """Activations a hair off a half step (x / s = 36.500008): fbgemm adds its zero point before
    rounding, where 164.500008 becomes the tie 164.5 and rounds to even. The layer rounds first, so
    its codes stay `quantize_per_token`'s and the result the int32 GEMM's."""
    if not cpu_features.fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    q, s = _narrow_layer(64, 96, 6)
    layer = W8A8Linear(q, s, torch.randn(64), path="fbgemm")
    assert layer.plan.fbgemm_act_bits == 8
    g = torch.Generator().manual_seed(6)
    halves = torch.randint(-120, 120, (16, 96), generator=g).float() + 0.5
    nudge = torch.where(torch.rand(16, 96, generator=g) < 0.5, -8e-6, 8e-6) * halves.abs()
    x = halves + nudge
    x[:, 0] = 127.0  # the row's scale: exactly 1, so x / s = x
    codes, _ = quantize_per_token(x)
    assert torch.equal(codes.float(), torch.round(x))  # the near-ties are there and round away
    _assert_per_token_int8(layer, x)
