"""A plan's weight precisions applied at load time: a pipeline stage rounds its own layers.

`tessel plan --precisions fp16,int8,int4` gives every unit (a decoder layer, or its attention / MLP
half at sublayer granularity) a weight precision, priced by the cost model (`tessel.cost.layer`):

    int8 -> W8A8: int8 weights per output channel (round to nearest, [-127, 127]), int8 activations
            per token at run time: `W8A8Linear`, the CPU path chosen by the CPU's features
    int4 -> W4A16: int4 weights in groups (round to nearest, [-8, 7], scale max|w| / 7.5), float
            activations; the group is the planner's 128 where it divides the row, else the largest
            power of two below it that does (64 for SmolLM2's 576); held de-quantised in --dtype
            (as `tessel.models.quantized.module_swap` runs int4 checkpoints)
    fp32 / fp16 / bf16 -> unchanged: the stage runs its float weights in --dtype

Round to nearest needs no calibration text, so a stage process can do it alone from the float
checkpoint; a calibrated checkpoint (`tessel quantize`) is the way to better accuracy.
"""

from __future__ import annotations

import torch
from torch import nn

from tessel.cost import layer as L
from tessel.errors import TesselError
from tessel.layers.linear import W8A8Linear, dequantized_linear
from tessel.models.quantized.schemes import make_scheme, quantize_weight

RUNNABLE = L.FLOAT_WEIGHTS | {"int8", "int4"}
# the fused linears of one decoder layer, per half
ATTENTION_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj")
MLP_LINEARS = ("mlp.gate_up_proj", "mlp.down_proj")


def int4_group(in_features: int) -> int:
    """The planner's group where it divides the row, else the largest power of two below it that does."""
    group = L.INT4_GROUP_SIZE
    while in_features % group:
        group //= 2
    if group < 2:
        raise TesselError(f"int4 weights need an even row length; a linear has in_features {in_features}")
    return group


def quantized_linear(linear: nn.Linear, precision: str, dtype: torch.dtype) -> nn.Module:
    """The module that runs `linear` at `precision` (a float precision returns it unchanged)."""
    if precision in L.FLOAT_WEIGHTS:
        return linear
    weight = linear.weight.detach().float().cpu()
    bias = None if linear.bias is None else linear.bias.detach().float()
    device = linear.weight.device
    if precision == "int8":
        qw = quantize_weight(weight, make_scheme("w8a8"))
        return W8A8Linear(qw.q.to(device), qw.scale.reshape(-1).to(device), _to(bias, device))
    if precision == "int4":
        qw = quantize_weight(weight, make_scheme("w4a16", group_size=int4_group(weight.shape[1])))
        return dequantized_linear(qw.dequantize().to(device), _to(bias, device), dtype)
    raise TesselError(
        f"weight precision {precision!r} cannot run; choose one of {', '.join(sorted(RUNNABLE))}"
    )


def quantize_layers(
    model: nn.Module, precisions: dict[int, tuple[str, str]], dtype: torch.dtype
) -> dict[str, int]:
    """Swap the linears of decoder layer i for its (attention, MLP) precisions; -> linears per precision."""
    swapped: dict[str, int] = {}
    for index, halves in precisions.items():
        layer = model.model.layers[index]
        for precision, names in zip(halves, (ATTENTION_LINEARS, MLP_LINEARS), strict=True):
            for name in names:
                owner, leaf = name.split(".")
                parent = getattr(layer, owner)
                module = quantized_linear(getattr(parent, leaf), precision, dtype)
                setattr(parent, leaf, module)
                swapped[precision] = swapped.get(precision, 0) + 1
    return swapped


def _to(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)
