"""tessel.layers Linear / W8A8Linear / W8A16Linear against nn.Linear.

Error bounds for the quantised layers, per output y = sum_k x_k w_k (float64 maths):
- W8A16: the weight error |w_k - q_k s_w| <= s_w / 2 (round to nearest), so
  |y - y_q| <= sum_k |x_k| * s_w / 2.
- W8A8: with the activation error also <= s_x / 2 per element,
  |x w - x_q w_q| <= |x| s_w / 2 + |w| s_x / 2 + s_x s_w / 4 per term, summed over k.
Both bounds are worst cases (every rounding error of maximal size, all of one sign); the tests
also check the typical relative error for Gaussian data: one int8 step is about 4 sigma / 127, so
each operand carries an RMS error of step / sqrt(12) ~ 1% of its RMS; the product ~1.3%.
On top comes one rounding of the output to the input dtype (the TOLERANCES below).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessel.errors import TesselError
from tessel.kernels import quantize_per_token
from tessel.kernels.cpu_features import ENV_OVERRIDE
from tessel.layers import Linear, W8A8Linear, W8A16Linear

OUTPUT_ROUNDING = {  # dtype: (atol, rtol) for one rounding of O(1) outputs to this dtype
    torch.float32: (1e-5, 1e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2.5e-2, 2.5e-2),
}
DTYPES = list(OUTPUT_ROUNDING)
IN_FEATURES, OUT_FEATURES = 70, 45


@pytest.fixture(params=["triton_backend", "torch_backend"])
def backend(request: pytest.FixtureRequest) -> str:
    request.getfixturevalue(request.param)
    return request.param


def float_linear(bias: bool = True, dtype: torch.dtype = torch.float32) -> nn.Linear:
    layer = nn.Linear(IN_FEATURES, OUT_FEATURES, bias=bias)
    return layer.to(dtype)


def inputs(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, 5, IN_FEATURES).to(dtype)  # [batch, tokens, features]: 10 rows


# ---- Linear -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_nn_linear(backend: str, dtype: torch.dtype, bias: bool) -> None:
    ref = float_linear(bias, dtype)
    layer = Linear(IN_FEATURES, OUT_FEATURES, bias=bias, dtype=dtype)
    layer.load_state_dict(ref.state_dict())  # same parameters and state_dict keys as nn.Linear
    x = inputs(dtype)
    with torch.no_grad():
        out = layer(x)
        expected = nn.functional.linear(
            x.double(), ref.weight.double(), None if not bias else ref.bias.double()
        )
    assert out.shape == (2, 5, OUT_FEATURES) and out.dtype == dtype
    atol, rtol = OUTPUT_ROUNDING[dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


def test_linear_gradients_match_nn_linear(backend: str) -> None:
    ref = float_linear()
    layer = Linear.from_linear(ref)
    assert layer.weight is ref.weight
    x1 = inputs().requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    (ref(x1) ** 2).sum().backward()
    grads_ref = [x1.grad, ref.weight.grad.clone(), ref.bias.grad.clone()]
    ref.zero_grad()
    (layer(x2) ** 2).sum().backward()
    for got, want in zip([x2.grad, layer.weight.grad, layer.bias.grad], grads_ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ---- W8A8Linear ---------------------------------------------------------------------------------


INT8_BACKENDS = {
    "triton": ("triton_backend", None),
    "torch-int_mm": ("torch_backend", "int_mm"),
    "torch-fp16codes": ("torch_backend", "fp16codes"),
    "torch-fbgemm": ("torch_backend", "fbgemm"),
    "torch-dequant": ("torch_backend", "dequant"),
}
EXACT_INT8_BACKENDS = [v for k, v in INT8_BACKENDS.items() if k != "torch-fbgemm"]  # 8-bit codes


@pytest.fixture(params=list(INT8_BACKENDS.values()), ids=list(INT8_BACKENDS))
def int8_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The Triton kernel, or each CPU int8 path of the PyTorch side (forced, whatever this CPU is)."""
    backend, path = request.param
    request.getfixturevalue(backend)
    if path is not None:
        monkeypatch.setenv(ENV_OVERRIDE, path)
    return path


def activation_step(x: torch.Tensor, path: str | None, fbgemm_levels: int = 127) -> torch.Tensor:
    """The activation quantisation step per row [M, 1]: absmax / 127 per token, or fbgemm's 7-bit
    (127 levels; 255 against 7-bit weight codes) step over the rows scaled to [-1, 1] (per tensor),
    times the row's absmax."""
    rows = x.reshape(-1, IN_FEATURES).double()
    _, s_x = quantize_per_token(rows.float())
    if path != "fbgemm":
        return s_x.double()[:, None]
    absmax = rows.abs().amax(1, keepdim=True)
    scaled = rows / absmax
    return (scaled.max().clamp(min=0) - scaled.min().clamp(max=0)) / fbgemm_levels * absmax


def w8a8_bound(
    x: torch.Tensor, layer: W8A8Linear, ref: nn.Linear, path: str | None = None, fbgemm_levels: int = 127
) -> torch.Tensor:
    rows = x.reshape(-1, IN_FEATURES).double()
    s_x = activation_step(x, path, fbgemm_levels)  # [M, 1]
    s_w = layer.weight_scale.double()[None, :]  # [1, N]
    abs_x_sum = rows.abs().sum(1, keepdim=True)  # sum_k |x_k|
    abs_w_sum = ref.weight.detach().double().abs().sum(1)[None, :]  # sum_k |w_k|
    return (abs_x_sum * s_w / 2 + abs_w_sum * s_x / 2 + IN_FEATURES * s_x * s_w / 4).reshape(2, 5, -1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_linear_within_quantisation_bound(int8_backend: str | None, dtype: torch.dtype) -> None:
    ref = float_linear()
    layer = W8A8Linear.from_linear(ref)
    x = inputs(dtype)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (2, 5, OUT_FEATURES)
    expected = ref.double()(x.double())
    err = (out.double() - expected).abs()
    atol, rtol = OUTPUT_ROUNDING[dtype]
    assert torch.all(err <= w8a8_bound(x, layer, ref, int8_backend) + atol + rtol * expected.abs())
    rel = (out.double() - expected).norm() / expected.norm()
    assert rel < 0.03, f"relative error {rel:.4f}; Gaussian data should give ~1.3% (7-bit: ~2%)"


def test_w8a8_linear_with_7bit_weight_codes_within_quantisation_bound(int8_backend: str | None) -> None:
    """`weight_code_bits=7`: codes in [-63, 63] (scale absmax / 63); fbgemm then takes 8-bit
    activation codes (255 levels per row), every other path the same integer products as before."""
    ref = float_linear()
    layer = W8A8Linear.from_linear(ref, weight_code_bits=7)
    assert torch.all(layer.weight.abs().amax(1) == 63)
    err_w = (layer.dequantized_weight() - ref.weight.detach()).abs()
    assert torch.all(err_w <= layer.weight_scale[:, None] / 2 * (1 + 1e-5))
    x = inputs()
    expected = ref.double()(x.double())
    err = (layer(x).double() - expected).abs()
    atol, rtol = OUTPUT_ROUNDING[torch.float32]
    assert torch.all(err <= w8a8_bound(x, layer, ref, int8_backend, 255) + atol + rtol * expected.abs())


def test_w8a8_linear_path_follows_the_weight_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    """On AVX2 (flags patched): 7-bit codes take fbgemm with 8-bit activations, full-range codes
    fp16codes; the choice is made again when a new weight is loaded; set_path forces one."""
    from tessel.kernels import cpu_features

    if not cpu_features.fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))
    ref = float_linear()
    layer = W8A8Linear.from_linear(ref, weight_code_bits=7)
    assert layer.path == "fbgemm" and layer.plan.fbgemm_act_bits == 8
    full = W8A8Linear.from_linear(ref)
    layer.load_state_dict(full.state_dict())  # full-range codes now
    assert layer.path == "fp16codes"
    x = inputs()
    assert torch.equal(layer(x), full(x))
    layer.set_path("fbgemm")
    assert layer.path == "fbgemm" and layer.plan.fbgemm_act_bits == 7
    layer.set_path(None)
    assert layer.path == "fp16codes"
    with pytest.raises(TesselError, match="unknown int8 path"):
        layer.set_path("vnni")
    with pytest.raises(TesselError, match="weight code bits"):
        W8A8Linear.from_linear(ref, weight_code_bits=6)


@pytest.mark.parametrize("int8_backend", EXACT_INT8_BACKENDS, indirect=True)
def test_w8a8_linear_is_exactly_quantise_then_gemm(int8_backend: str | None) -> None:
    """The layer computes (q_x s_x) @ (q_w s_w).T + b: check against that in float64 (fbgemm's
    7-bit codes: `test_w8a8_linear_within_quantisation_bound` holds it to its bound)."""
    ref = float_linear()
    layer = W8A8Linear.from_linear(ref)
    x = inputs()
    q_x, s_x = quantize_per_token(x.reshape(-1, IN_FEATURES))
    deq_x = q_x.double() * s_x.double()[:, None]
    deq_w = layer.weight.double() * layer.weight_scale.double()[:, None]
    expected = (deq_x @ deq_w.t() + layer.bias.double()).reshape(2, 5, -1)
    torch.testing.assert_close(layer(x).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.dequantized_weight().double(), deq_w)


def test_w8a8_linear_weights_are_per_channel_int8(int8_backend: str | None) -> None:
    ref = float_linear(bias=False)
    ref.weight.data[3] *= 100  # one loud channel must not coarsen the others' scales
    layer = W8A8Linear.from_linear(ref)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (OUT_FEATURES,)
    assert layer.bias is None
    assert torch.all(layer.weight.abs().amax(1) == 127)
    err = (layer.dequantized_weight() - ref.weight.detach()).abs()
    assert torch.all(err <= layer.weight_scale[:, None] / 2 * (1 + 1e-5))
    state = layer.state_dict()
    assert set(state) == {"weight", "weight_scale"}
    again = W8A8Linear(torch.zeros(OUT_FEATURES, IN_FEATURES, dtype=torch.int8), torch.ones(OUT_FEATURES))
    again.load_state_dict(state)
    assert torch.equal(again.weight, layer.weight)
    x = inputs()
    assert torch.equal(again(x), layer(x))  # the path's weight forms follow the loaded weight


def test_w8a8_linear_validates_its_int8_tensors() -> None:
    with pytest.raises(TesselError):
        W8A8Linear(torch.zeros(4, 3), torch.ones(4))
    with pytest.raises(TesselError):
        W8A8Linear(torch.zeros(4, 3, dtype=torch.int8), torch.ones(5))
    layer = W8A8Linear(torch.ones(4, 3, dtype=torch.int8), torch.full((4,), 0.5), torch.arange(4.0))
    out = layer(torch.ones(2, 3))
    torch.testing.assert_close(out, torch.tensor([[1.5, 2.5, 3.5, 4.5]] * 2))
    with pytest.raises(TesselError):
        layer(torch.ones(2, 4))


# ---- W8A16Linear --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a16_linear_within_quantisation_bound(backend: str, dtype: torch.dtype) -> None:
    ref = float_linear()
    layer = W8A16Linear.from_linear(ref)
    x = inputs(dtype)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (2, 5, OUT_FEATURES)
    expected = ref.double()(x.double())
    bound = x.double().abs().sum(-1, keepdim=True) * layer.weight_scale.double() / 2
    atol, rtol = OUTPUT_ROUNDING[dtype]
    assert torch.all((out.double() - expected).abs() <= bound + atol + rtol * expected.abs())
    if dtype == torch.float32:
        rel = (out.double() - expected).norm() / expected.norm()
        assert rel < 0.02, f"relative error {rel:.4f}; Gaussian weights should give ~1%"


@pytest.mark.parametrize("cls", [W8A8Linear, W8A16Linear])
def test_quantized_layers_keep_float32_scales_through_dtype_casts(backend: str, cls) -> None:
    ref = float_linear()
    layer = cls.from_linear(ref)
    scale = layer.weight_scale.clone()
    layer = layer.to(torch.bfloat16).half()  # what model.to(dtype) does to every submodule
    assert layer.weight.dtype == torch.int8
    assert layer.weight_scale.dtype == torch.float32 and torch.equal(layer.weight_scale, scale)
    assert layer.bias.dtype == torch.float32
    x = inputs(torch.float16)
    assert layer(x).dtype == torch.float16
