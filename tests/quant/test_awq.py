"""AWQ's activation-aware scaling (tessel.quant.awq).

Oracles: the published formula s = mean|x|^alpha / sqrt(max * min) computed directly; the alpha
search against a direct float64 loop over the grid; folding the scales into a Hugging Face Llama
keeps its logits (the float function is unchanged); on a layer with a few salient input channels
the AWQ-scaled int4 outputs are closer to the float ones than plain rounding's on held-out rows.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tessel.models.quantized.schemes import make_scheme, quantize_weight
from tessel.quant.awq import AWQ_ALPHA_GRID, awq_group, awq_scales, best_awq_alpha
from tessel.quant.smoothquant import InputRecorder, SmoothGroup, smooth_groups


def _salient_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[:, ::64] *= 30.0  # one input channel in 64 carries large activations (AWQ's observation)
    return x


def _group(n: int, k: int, seed: int) -> SmoothGroup:
    torch.manual_seed(seed)
    norm = nn.LayerNorm(k)
    return SmoothGroup("g", norm, [nn.Linear(k, n, bias=False), nn.Linear(k, n // 2 + 1, bias=False)])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0, 1e3), min_size=2, max_size=40), st.sampled_from(AWQ_ALPHA_GRID + (1.0,)))
def test_scales_follow_the_published_formula(mean_abs, alpha):
    m = torch.tensor(mean_abs, dtype=torch.float64)
    s = m.clamp(min=1e-4) ** alpha
    expected = s / torch.sqrt(s.max() * s.min())
    got = awq_scales(m.float(), alpha)
    assert torch.isfinite(got).all() and (got > 0).all()
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=0)


@pytest.mark.parametrize("n, k, group", [(24, 64, 16), (7, 96, 32), (13, 40, None)])
def test_alpha_is_the_grid_point_of_least_output_error(n, k, group):
    scheme = make_scheme("w4a16" if group else "w8a16", group_size=group)
    grp = _group(n, k, seed=n + k)
    rows = _salient_rows(200, k, seed=k)
    weight = torch.cat([lin.weight.detach() for lin in grp.linears]).double()
    errors = []
    for alpha in AWQ_ALPHA_GRID:
        s32 = awq_scales(rows.abs().mean(0), alpha)  # the formula is held to the paper above
        s = s32.double()
        q = quantize_weight(weight.float() * s32, scheme).dequantize().double()
        errors.append(float(((rows.double() / s) @ q.T - rows.double() @ weight.T).pow(2).sum()))
    got = best_awq_alpha(grp, rows, scheme)
    assert errors[AWQ_ALPHA_GRID.index(got)] <= min(errors) * (1 + 1e-5)


def test_scaling_beats_plain_rounding_on_held_out_rows():
    scheme = make_scheme("w4a16", group_size=32)
    grp = _group(48, 128, seed=3)
    weight = torch.cat([lin.weight.detach().clone() for lin in grp.linears])
    recorder = InputRecorder()
    recorder.observe(_salient_rows(256, 128, seed=4))
    alpha = awq_group(grp, recorder, scheme)
    assert alpha > 0
    held_out = _salient_rows(256, 128, seed=5)
    scales = grp.producer.weight.detach().reciprocal()  # LayerNorm weight started at 1
    awq = quantize_weight(torch.cat([lin.weight.detach() for lin in grp.linears]), scheme).dequantize()
    rtn = quantize_weight(weight, scheme).dequantize()
    ref = held_out @ weight.T
    err_awq = torch.linalg.norm((held_out / scales) @ awq.T - ref)
    err_rtn = torch.linalg.norm(held_out @ rtn.T - ref)
    assert err_awq < 0.97 * err_rtn


def test_folding_keeps_the_model_function(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ids = torch.randint(4, 300, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    scheme = make_scheme("w4a16", group_size=16)
    recorders: dict[str, InputRecorder] = {}
    groups = smooth_groups(model)
    handles = []
    for g in groups:
        recorders[g.name] = InputRecorder()
        handles.append(
            g.linears[0].register_forward_pre_hook(
                lambda _m, a, r=recorders[g.name]: r.observe(a[0].reshape(-1, a[0].shape[-1]))
            )
        )
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    alphas = [awq_group(g, recorders[g.name], scheme) for g in groups]
    assert all(a in AWQ_ALPHA_GRID for a in alphas)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4 * float(before.abs().max()))


@settings(max_examples=60, deadline=None)
@given(
    scheme=st.sampled_from(["w8a8", "w8a16", "w4a16", "w4a8", ""]),
    method=st.sampled_from(["rtn", "gptq", "awq", "GPTQ"]),
    awq=st.booleans(),
    act_order=st.booleans(),
    static_groups=st.booleans(),
    smoothquant=st.sampled_from([None, 0.5, "auto", "x"]),
    calib=st.sampled_from([None, "calib.txt"]),
)
def test_fuzzed_method_options_are_valid_or_a_tessel_error(
    scheme, method, awq, act_order, static_groups, smoothquant, calib
):
    from tessel.errors import TesselError
    from tessel.quant.calibrate import QuantizeOptions

    try:
        options = QuantizeOptions(
            scheme,
            smoothquant=smoothquant,
            calib=calib,
            group_size=16 if scheme.endswith("a16") else None,
            method=method,
            act_order=act_order,
            static_groups=static_groups,
            awq=awq,
        )
    except TesselError:
        return
    assert options.method in ("rtn", "gptq")
    assert not (options.awq and options.smoothquant is not None)
    assert (options.act_order or options.static_groups) <= (options.method == "gptq")
    assert options.calib is not None or not (options.awq or options.method == "gptq")
