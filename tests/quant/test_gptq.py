"""GPTQ against the published algorithm written the slow way, and against round to nearest.

Oracle: Frantar et al.'s update done literally, column by column in float64, with the inverse
Hessian of the columns not yet rounded recomputed by `torch.linalg.inv` every time (no Cholesky
rows, no lazy blocks). tessel's fast version must give the same integer codes and scales.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tessel.cli import app
from tessel.errors import TesselError
from tessel.models.quantized.schemes import make_scheme, quantize_weight
from tessel.quant.gptq import PERCDAMP, GPTQOptions, HessianAccumulator, gptq_quantize
from tessel.quant.observers import make_observer


def _scale(columns: torch.Tensor, scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point) per row of a group; asymmetric ones by compressed-tensors' own rule."""
    if scheme.symmetric:
        obs = make_observer("minmax", scheme.weight_range, axis=0)
        obs.observe(columns.float())
        return obs.qparams()[0].double(), torch.zeros(columns.shape[0], dtype=torch.float64)
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=scheme.weight_bits, symmetric=False, strategy="channel")
    lo, hi = columns.float().amin(dim=1), columns.float().amax(dim=1)
    scale, zero_point = calculate_qparams(lo, hi, args)
    return scale.double(), zero_point.double()


def _slow_gptq(weight, hessian, scheme, act_order=False, static_groups=False):
    """The OBS update of one column at a time, the remaining columns' inverse Hessian inverted anew."""
    n, k = weight.shape
    group = scheme.group_size or k
    qmin, qmax = scheme.weight_range.qmin, scheme.weight_range.qmax
    w = weight.double().clone()
    h = hessian.double().clone()
    h += PERCDAMP * torch.mean(torch.diag(h)) * torch.eye(k, dtype=torch.float64)
    scales = torch.zeros(n, k // group, dtype=torch.float64)
    zeros = torch.zeros(n, k // group, dtype=torch.float64)
    static = act_order or static_groups
    if static:
        for g in range(0, k, group):
            scales[:, g // group], zeros[:, g // group] = _scale(w[:, g : g + group], scheme)
    if act_order:
        order = torch.argsort(torch.diag(hessian.double()), descending=True, stable=True).tolist()
    else:
        order = list(range(k))
    codes = torch.zeros(n, k, dtype=torch.int8)
    for position, column in enumerate(order):
        if not static and column % group == 0:
            scales[:, column // group], zeros[:, column // group] = _scale(
                w[:, column : column + group], scheme
            )
        scale, zero = scales[:, column // group], zeros[:, column // group]
        q = torch.clamp(torch.round(w[:, column] / scale) + zero, qmin, qmax)
        codes[:, column] = q.to(torch.int8)
        remaining = order[position:]
        inverse = torch.linalg.inv(h[remaining][:, remaining])
        error = (w[:, column] - (q - zero) * scale) / inverse[0, 0]
        w[:, remaining] -= error[:, None] * inverse[0][None, :]
    return codes, scales, zeros


def _problem(seed: int, n: int, k: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * k, 8, generator=gen, dtype=torch.float64) @ torch.randn(
        8, k, generator=gen, dtype=torch.float64
    )
    x += 0.2 * torch.randn(4 * k, k, generator=gen, dtype=torch.float64)
    x[:, 1] *= 5.0  # one loud input channel, as LLM activations have
    acc = HessianAccumulator(k)
    acc.add(x)
    return torch.randn(n, k, generator=gen, dtype=torch.float64) * 0.1, acc.hessian, x


@pytest.mark.parametrize(
    ("scheme_name", "group", "act_order", "block", "static", "symmetric"),
    [
        ("w4a16", 16, False, 32, False, True),
        ("w4a16", 16, True, 32, False, True),
        ("w8a16", None, False, 16, False, True),
        ("w4a16", 8, False, 12, False, True),
        ("w4a16", 16, False, 32, True, True),
        ("w4a16", 8, True, 12, True, True),
        ("w4a16", 16, False, 32, False, False),
        ("w4a16", 8, True, 12, False, False),
        ("w8a16", None, False, 16, False, False),
    ],
)
def test_fast_gptq_gives_the_codes_of_the_slow_published_algorithm(
    scheme_name, group, act_order, block, static, symmetric
):
    if not symmetric:
        pytest.importorskip("compressed_tensors")
    scheme = make_scheme(scheme_name, group_size=group, symmetric=symmetric)
    weight, hessian, _ = _problem(seed=7, n=12, k=48)
    fast = gptq_quantize(
        weight, hessian, scheme, GPTQOptions(act_order=act_order, block=block, static_groups=static)
    )
    codes, scales, zeros = _slow_gptq(weight, hessian, scheme, act_order, static)
    assert torch.equal(fast.q, codes)
    torch.testing.assert_close(fast.scale.double(), scales, rtol=1e-5, atol=0)
    if symmetric:
        assert fast.zero_point is None
    else:
        assert torch.equal(fast.zero_point.double(), zeros)


@pytest.mark.parametrize("scheme_name", ["w4a16", "w8a16"])
def test_gptq_reconstructs_the_layer_output_better_than_round_to_nearest(scheme_name):
    scheme = make_scheme(scheme_name, group_size=16 if scheme_name == "w4a16" else None)
    weight, hessian, x = _problem(seed=3, n=32, k=64)
    reference = x @ weight.t()

    def error(quantized) -> float:
        return float((x @ quantized.dequantize().double().t() - reference).norm() / reference.norm())

    rtn = error(quantize_weight(weight.float(), scheme))
    assert error(gptq_quantize(weight, hessian, scheme)) < 0.7 * rtn
    assert error(gptq_quantize(weight, hessian, scheme, GPTQOptions(act_order=True))) < 0.7 * rtn


def test_hessian_accumulates_the_mean_over_batches():
    x = torch.randn(50, 6, dtype=torch.float64)
    acc = HessianAccumulator(6)
    for part in (x[:7], x[7:30], x[30:]):
        acc.add(part)
    torch.testing.assert_close(acc.hessian, 2 * x.t() @ x / 50)


def test_dead_input_columns_get_zero_codes():
    scheme = make_scheme("w8a16")
    weight, hessian, _ = _problem(seed=1, n=4, k=16)
    hessian[3, :] = hessian[:, 3] = 0.0
    out = gptq_quantize(weight, hessian, scheme)
    assert torch.all(out.q[:, 3] == 0)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    groups=st.integers(1, 3),
    group=st.sampled_from([4, 8]),
    rank=st.integers(0, 10),
    scale=st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 1e20]),
    act_order=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_weight_and_hessian_give_codes_in_range_or_a_tessel_error(
    n, groups, group, rank, scale, act_order, seed
):
    k = groups * group
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rank, k, generator=gen, dtype=torch.float64)
    acc = HessianAccumulator(k)
    if rank:
        acc.add(x)
    weight = torch.randn(n, k, generator=gen) * scale
    try:
        scheme = make_scheme("w4a16", group_size=group)
        out = gptq_quantize(weight, acc.hessian, scheme, GPTQOptions(act_order=act_order))
    except TesselError as error:
        assert "Hessian" in str(error)
        return
    assert out.q.shape == (n, k) and -8 <= int(out.q.min()) and int(out.q.max()) <= 7
    assert torch.isfinite(out.scale).all() and bool((out.scale > 0).all())


def test_gptq_without_calibration_text_is_a_user_error_and_writes_nothing(tiny_llama, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama), "--out", str(out), "--method", "gptq"])
    assert isinstance(result.exception, TesselError) and "give --calib FILE" in str(result.exception)
    assert not out.exists()
