"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before quantising.

For a producer followed by linears that read its output, per input channel j:

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)      (max|W_j| over every consumer's column j)
    producer's output channel j /= s_j,   W[:, j] *= s_j      so  (X / s) @ (W * s).T == X @ W.T

The function computed is unchanged (tested against the unsmoothed model); the activations the
linears see are flatter, the weights a little less so. The groups per layer come from
`tessel.quant.layer_map` (for Llama: input_layernorm -> q/k/v, post_attention_layernorm -> gate/up,
up_proj -> down_proj, the third being one of llm-compressor's AWQ mappings); a norm's weight is
divided (Gemma's (1 + w) as a whole), a producing linear's output rows are (Phi-3: only the up half
of gate_up_proj), and readers kept in float (MoE routers) are scaled with the quantised ones.
down_proj's input carries the largest outliers of SmolLM2-135M (fake-quantising only down_proj
costs the most perplexity, and smoothing with alpha 0.5 halves it: docs/results.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tessel.errors import TesselError
from tessel.quant.layer_map import model_maps

MIN_AMAX = 1e-5  # the paper's clamp: a channel that never fires gets no huge scale
SMOOTHQUANT_ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # `--smoothquant auto` picks one per group
SAMPLE_ROWS_PER_BATCH = 64  # input rows kept per calibration window for the auto search


@dataclass(slots=True)
class SmoothGroup:
    """A producer (a norm, or a linear) whose output feeds `linears` (all [*, K], quantised) and
    `float_readers` (a router: scaled with them, left in float); one scale per channel."""

    name: str
    producer: nn.Module
    linears: list[nn.Module]
    float_readers: list[nn.Module] = field(default_factory=list)
    producer_rows: slice | None = None  # the producer's output rows that are the tensor (Phi-3's up half)
    unit_offset: bool = False  # the producer is a norm computing x * (1 + w) (Gemma)

    @property
    def recorded_at(self) -> nn.Module:
        """The module whose input is the whole tensor (a router sees every token, an expert some)."""
        return (self.float_readers or self.linears)[0]


def smooth_groups(model: nn.Module) -> list[SmoothGroup]:
    """Every smoothable group of a transformers causal LM (`tessel.quant.layer_map`), named after the
    module its input is recorded at."""
    groups = []
    for i, (layer, spec_map) in enumerate(zip(model.model.layers, model_maps(model), strict=True)):
        for spec in spec_map.smooth:
            producer = layer.get_submodule(spec.producer)
            rows = None
            if spec.producer_rows == "second_half":
                half = producer.weight.shape[0] // 2
                rows = slice(half, 2 * half)
            groups.append(
                SmoothGroup(
                    f"model.layers.{i}.{spec.recorded_at}",
                    producer,
                    [layer.get_submodule(n) for n in spec.linears],
                    [layer.get_submodule(n) for n in spec.float_readers],
                    rows,
                    spec.unit_offset,
                )
            )
    return groups


def smoothing_scales(act_amax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s = amax_x^alpha / amax_w^(1 - alpha) per input channel (float32 [K])."""
    if not 0.0 <= alpha <= 1.0:
        raise TesselError(f"--smoothquant alpha must be in [0, 1]; got {alpha}")
    w_amax = torch.cat([w.detach().abs().float() for w in weights]).amax(dim=0)
    a = act_amax.float().clamp(min=MIN_AMAX)
    w = w_amax.clamp(min=MIN_AMAX)
    return (a.pow(alpha) / w.pow(1 - alpha)).clamp(min=MIN_AMAX)


@torch.no_grad()
def smooth_group(group: SmoothGroup, act_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """Fold the scales into the producer and its consumers in place; -> the scales."""
    scales = smoothing_scales(act_amax, [lin.weight for lin in group.linears], alpha)
    fold_scales(group, scales)
    return scales


@torch.no_grad()
def fold_scales(group: SmoothGroup, scales: torch.Tensor) -> None:
    """producer's output channel j /= s_j, every reader's column j *= s_j (in place)."""
    producer = group.producer
    if isinstance(producer, nn.Linear):  # its output rows (Phi-3: only the up half of gate_up_proj)
        rows = group.producer_rows or slice(None)
        weight = producer.weight[rows]
        weight.copy_((weight.float() / scales[:, None]).to(weight.dtype))
        if producer.bias is not None:
            bias = producer.bias[rows]
            bias.copy_((bias.float() / scales).to(bias.dtype))
    elif group.unit_offset:  # x * (1 + w): (1 + w) / s = 1 + w'
        producer.weight.copy_(((1 + producer.weight.float()) / scales - 1).to(producer.weight.dtype))
    else:  # a norm's elementwise weight
        producer.weight.copy_((producer.weight.float() / scales).to(producer.weight.dtype))
    for lin in [*group.linears, *group.float_readers]:
        lin.weight.copy_((lin.weight.float() * scales[None, :]).to(lin.weight.dtype))


class InputRecorder:
    """Per-channel max|x| of a linear's input, plus a sample of its rows (for `auto` alpha)."""

    def __init__(self) -> None:
        self.amax: torch.Tensor | None = None
        self.rows: list[torch.Tensor] = []

    def observe(self, x: torch.Tensor) -> None:
        x = x.detach().float()
        amax = x.abs().amax(dim=0)
        self.amax = amax if self.amax is None else torch.max(self.amax, amax)
        stride = max(1, x.shape[0] // SAMPLE_ROWS_PER_BATCH)
        self.rows.append(x[::stride][:SAMPLE_ROWS_PER_BATCH].clone())


def _fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per row (per token for activations, per output channel for weights)."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(x / scale) * scale


def alpha_error(group: SmoothGroup, rows: torch.Tensor, act_amax: torch.Tensor, alpha: float) -> float:
    """Squared error of the group's W8A8 outputs on `rows` after smoothing with `alpha`."""
    weight = torch.cat([lin.weight.detach().float() for lin in group.linears])
    scales = smoothing_scales(
        act_amax, list(group.linears[i].weight for i in range(len(group.linears))), alpha
    )
    reference = rows @ weight.t()
    quantised = _fake_quant_rows(rows / scales) @ _fake_quant_rows(weight * scales).t()
    return float(((quantised - reference) ** 2).sum())


def best_alpha(
    group: SmoothGroup, recorder: InputRecorder, grid: tuple[float, ...] = SMOOTHQUANT_ALPHA_GRID
) -> float:
    """The alpha of `grid` whose smoothing gives the least W8A8 output error on the recorded rows."""
    rows = torch.cat(recorder.rows)
    errors = [alpha_error(group, rows, recorder.amax, alpha) for alpha in grid]
    return grid[min(range(len(grid)), key=errors.__getitem__)]
