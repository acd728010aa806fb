"""A plan's int8 (W8A8) layers on tensor-parallel ranks, equal to one process's.

Column-parallel linears (qkv_proj, gate_up_proj) hold whole output rows: each rank rounds its rows
as one process does (`quantized_linear`), scales included. A row-parallel linear (o_proj,
down_proj) holds a slice of every row, so two things one process computes over the whole row would
change: the weight's per-row scale (max |w| over the row) and the activations' per-token scale
(max |x| over the token's inputs). Both are the maximum over the ranks' slices, exactly: the ranks
all-reduce their slices' maxima, and each rank quantises with the whole row's maximum by giving its
slice one more column holding it (`_with_row_max`): the weight's extra column then sets the row's
scale and is dropped; at run time the input's extra column sets the token's scale and meets a zero
weight column, so it adds nothing to the integer sums. The codes and scales are one process's; only
the float sum of the ranks' dequantised partial products is rounded in another order (as in a float
row-parallel linear).
"""

from __future__ import annotations

import torch
from torch import nn

from tessel.errors import TesselError
from tessel.layers.linear import W8A8Linear
from tessel.models.quantized.load_quantize import ATTENTION_LINEARS, MLP_LINEARS, quantized_linear
from tessel.models.quantized.schemes import make_scheme, quantize_weight
from tessel.parallel.group import TPGroup

ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
TP_PRECISIONS = frozenset({"fp32", "fp16", "bf16", "int8"})


class RowMaxInput(nn.Module):
    """A row-parallel W8A8 layer's input quantised by the whole row: x [T, K/degree] gets one more
    column, the token's max |x| over every rank's slice, which the per-token quantiser then scales by."""

    def __init__(self, inner: W8A8Linear, group: TPGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = [group]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        row_max = self.group[0].all_reduce_max(rows.abs().amax(dim=-1).contiguous())
        out = self.inner(torch.cat([rows, row_max.to(rows.dtype).unsqueeze(-1)], dim=-1))
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _with_row_max(weight: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    return torch.cat([weight, row_max.unsqueeze(-1)], dim=-1)


def row_parallel_int8(linear: nn.Linear, group: TPGroup) -> RowMaxInput:
    """The rank's W8A8 form of a row-parallel linear, rounded as the whole row is."""
    weight = linear.weight.detach().float().cpu()
    row_max = group.all_reduce_max(weight.abs().amax(dim=-1).contiguous())
    qw = quantize_weight(_with_row_max(weight, row_max), make_scheme("w8a8"))
    q = qw.q.clone()
    q[:, -1] = 0  # the input's extra column meets zeros: nothing added to the sums
    bias = None if linear.bias is None else linear.bias.detach().float()
    device = linear.weight.device
    inner = W8A8Linear(
        q.to(device), qw.scale.reshape(-1).to(device), None if bias is None else bias.to(device)
    )
    return RowMaxInput(inner, group)


def quantize_rank_layers(
    model: nn.Module, precisions: dict[int, tuple[str, str]], dtype: torch.dtype, group: TPGroup
) -> None:
    """Swap a rank's linears (before `parallelise`) for the plan's precisions of each layer."""
    for index in sorted(precisions):
        layer = model.model.layers[index]
        for precision, names in zip(precisions[index], (ATTENTION_LINEARS, MLP_LINEARS), strict=True):
            if precision not in TP_PRECISIONS:
                raise TesselError(
                    f"layer {index}: weight precision {precision!r} cannot run tensor-parallel yet; "
                    f"use one of {', '.join(sorted(TP_PRECISIONS))}"
                )
            for name in names:
                owner, leaf = name.split(".")
                parent = getattr(layer, owner)
                linear = getattr(parent, leaf)
                if precision == "int8" and name in ROW_PARALLEL:
                    setattr(parent, leaf, row_parallel_int8(linear, group))
                else:
                    setattr(parent, leaf, quantized_linear(linear, precision, dtype))
