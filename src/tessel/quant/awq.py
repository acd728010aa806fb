"""AWQ's activation-aware scaling (Lin et al., MLSys 2024) for weight-only schemes.

Weight channels that meet large activations matter most; scaling them up before rounding gives
them relatively finer levels. For a producer followed by linears reading its output (the same
groups as SmoothQuant: input_layernorm -> q/k/v, post_attention_layernorm -> gate/up,
up_proj -> down_proj), per input channel j:

    s_j = mean|X_j|^alpha, normalised by sqrt(max s * min s)      (llm-awq's rule)
    W[:, j] *= s_j (then quantised), producer's output channel j /= s_j   (the float function stays)

alpha is searched per group on AWQ_ALPHA_GRID (llm-awq: 20 points in [0, 1)) for the least squared
error of the group's outputs on the calibration rows, ||X W^T - (X / s) Q(W * s)^T||, with Q the
scheme's own weight rounding; alpha 0 (s = 1) is in the grid, so the search never does worse than
plain rounding on those rows. mean|X_j| is taken over the recorded rows (SmoothQuant's recorder:
SAMPLE_ROWS_PER_BATCH rows per calibration window).
"""

from __future__ import annotations

import torch

from tessel.models.quantized.schemes import Scheme, quantize_weight
from tessel.quant.smoothquant import InputRecorder, SmoothGroup, fold_scales

AWQ_ALPHA_GRID = tuple(i / 20 for i in range(20))  # llm-awq's n_grid = 20
MIN_SCALE = 1e-4  # llm-awq clamps the activation statistic from below


def awq_scales(act_mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha / sqrt(max * min) per input channel (float32 [K])."""
    s = act_mean_abs.float().clamp(min=MIN_SCALE).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def awq_error(
    group: SmoothGroup,
    rows: torch.Tensor,
    scales: torch.Tensor,
    scheme: Scheme,
    reference: torch.Tensor | None = None,
) -> float:
    """||rows W^T - (rows / s) Q(W * s)^T||^2 over the group's linears stacked (float64 sum);
    `reference`: rows W^T when the caller has it already."""
    weight = torch.cat([lin.weight.detach().float() for lin in group.linears])
    quantised = quantize_weight(weight * scales[None, :], scheme).dequantize()
    if reference is None:
        reference = rows @ weight.t()
    return float(((rows / scales) @ quantised.t() - reference).double().pow(2).sum())


def best_awq_alpha(
    group: SmoothGroup, rows: torch.Tensor, scheme: Scheme, grid: tuple[float, ...] = AWQ_ALPHA_GRID
) -> float:
    """The alpha of `grid` whose AWQ scales give the group the least output error on `rows`."""
    mean_abs = rows.abs().mean(dim=0)
    reference = rows @ torch.cat([lin.weight.detach().float() for lin in group.linears]).t()
    errors = [awq_error(group, rows, awq_scales(mean_abs, alpha), scheme, reference) for alpha in grid]
    return grid[min(range(len(grid)), key=errors.__getitem__)]


@torch.no_grad()
def awq_group(group: SmoothGroup, recorder: InputRecorder, scheme: Scheme) -> float:
    """Search the group's alpha and fold its scales into the producer and the linears; -> alpha."""
    rows = torch.cat(recorder.rows)
    alpha = best_awq_alpha(group, rows, scheme)
    fold_scales(group, awq_scales(rows.abs().mean(dim=0), alpha))
    return alpha
