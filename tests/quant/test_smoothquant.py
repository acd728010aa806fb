"""SmoothQuant keeps the function: the smoothed float model against the original, in HF transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tessel.errors import TesselError
from tessel.quant.smoothquant import (
    SMOOTHQUANT_ALPHA_GRID,
    InputRecorder,
    best_alpha,
    smooth_group,
    smooth_groups,
    smoothing_scales,
)


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8, 1.0])
def test_smoothed_model_computes_the_same_logits(tiny_llama, alpha: float) -> None:
    reference, smoothed = _hf(tiny_llama), _hf(tiny_llama)
    ids = torch.randint(4, reference.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1)
    for group in smooth_groups(smoothed):
        # outlier-heavy activation maxima, as SmoothQuant meets them in real LLMs
        act_amax = torch.rand(group.linears[0].in_features, generator=g) * 2 + 0.01
        act_amax[torch.randint(0, act_amax.numel(), (3,), generator=g)] *= 50
        scales = smooth_group(group, act_amax, alpha)
        assert torch.all(scales > 0)
    changed = [
        n for (n, a), (_, b) in zip(reference.named_parameters(), smoothed.named_parameters(), strict=True)
        if not torch.equal(a, b)
    ]  # fmt: skip
    if alpha > 0:
        assert any("layernorm" in n for n in changed) and any("q_proj" in n for n in changed)
        assert any("up_proj" in n for n in changed) and any("down_proj" in n for n in changed)
    with torch.no_grad():
        expected = reference(ids).logits
        got = smoothed(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_scales_follow_the_formula() -> None:
    act = torch.tensor([4.0, 0.25, 1e-9, 9.0])
    w = [torch.tensor([[1.0, -2.0, 0.5, 3.0]]), torch.tensor([[-0.5, 1.0, 0.25, -9.0]])]
    s = smoothing_scales(act, w, 0.5)
    w_amax = torch.tensor([1.0, 2.0, 0.5, 9.0])
    expected = act.clamp(min=1e-5).sqrt() / w_amax.sqrt()
    torch.testing.assert_close(s, expected)
    with pytest.raises(TesselError, match="alpha"):
        smoothing_scales(act, w, 1.5)


def test_smoothing_flattens_the_activation_outliers(tiny_llama) -> None:
    model = _hf(tiny_llama)
    group = smooth_groups(model)[0]
    act_amax = torch.ones(group.linears[0].in_features)
    act_amax[5] = 100.0
    scales = smooth_group(group, act_amax, 0.5)
    smoothed_amax = act_amax / scales
    assert float(smoothed_amax.max() / smoothed_amax.median()) < float(act_amax.max() / act_amax.median())


def test_auto_alpha_is_the_grid_point_of_least_w8a8_output_error(tiny_llama) -> None:
    model = _hf(tiny_llama)
    group = smooth_groups(model)[2]  # up_proj -> down_proj
    recorder = InputRecorder()
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(40, group.linears[0].in_features, generator=g)
        x[:, 7] *= 60  # an outlier channel
        recorder.observe(x)
    chosen = best_alpha(group, recorder)
    rows = torch.cat(recorder.rows)
    weight = group.linears[0].weight.detach().double()
    errors = {}
    # direct: smooth, quantise both operands per row to int8, compare outputs
    for alpha in SMOOTHQUANT_ALPHA_GRID:
        s = smoothing_scales(recorder.amax, [group.linears[0].weight], alpha).double()
        xs, ws = rows.double() / s, weight * s
        sx = xs.abs().amax(dim=1, keepdim=True) / 127
        sw = ws.abs().amax(dim=1, keepdim=True) / 127
        out = (torch.round(xs / sx) * sx) @ (torch.round(ws / sw) * sw).t()
        errors[alpha] = float(((out - rows.double() @ weight.t()) ** 2).sum())
    assert errors[chosen] <= min(errors.values()) * (1 + 1e-4)
    assert errors[chosen] < errors[0.3] or chosen == 0.3
