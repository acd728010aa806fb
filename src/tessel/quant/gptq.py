"""GPTQ (Frantar et al., ICLR 2023): weights rounded one input column at a time, each rounding error
compensated on the columns not yet rounded, using the inverse Hessian of the layer's reconstruction
loss ||X W^T - X Q^T||^2 (H = 2 X^T X over the calibration tokens X).

For column i, with H^-1 the inverse Hessian of the columns not yet rounded (i first):

    q_i = Q(w_i);   e = (w_i - q_i) / [H^-1]_ii;   w_j <- w_j - e [H^-1]_ij  for the later columns j

The reference implementation's three tricks are here too: the rows of the upper Cholesky factor of
H^-1 give every [H^-1 of the remaining columns]_i row at once (no re-inversion per column); updates
are applied lazily, `BLOCK_COLUMNS` columns at a time; H is dampened by `percdamp` of its mean diagonal.
Groups (w4a16): a group's scale is computed from the group's columns as they stand when its first
column is reached (the reference's rule), so the compensation of earlier groups shapes it.
Act-order (`act_order=True`): columns are taken by descending H_ii; the group scales are then fixed
up front from the un-updated weights in the natural column order (llm-compressor's "static" act
order), so the checkpoint keeps contiguous groups and needs no column index.

Rows are independent given H, so linears reading the same input (q/k/v, gate/up) are rounded as one
stacked matrix against their shared Hessian.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tessel.errors import TesselError
from tessel.models.quantized.schemes import QuantizedWeight, Scheme, quantize_weight
from tessel.quant.layer_map import model_maps
from tessel.quant.observers import make_observer, weight_qparams
from tessel.quant.progress import StepProgress, report

BLOCK_COLUMNS = 128  # columns per lazy update (the reference's blocksize)
PERCDAMP = 0.01  # dampening: this fraction of mean(diag H) added to the diagonal


@dataclass(frozen=True, slots=True)
class GPTQOptions:
    """How GPTQ rounds (llm-compressor's GPTQModifier fields). `static_groups`: every group's scale from
    the un-updated weights up front (as with act-order; llm-compressor's rule) instead of when the
    group starts; `observer`: the weight observer of the group scales."""

    act_order: bool = False
    percdamp: float = PERCDAMP
    observer: str = "minmax"
    block: int = BLOCK_COLUMNS
    static_groups: bool = False


class HessianAccumulator:
    """H = 2 / n sum_t x_t x_t^T over the n rows seen (float64 accumulation)."""

    def __init__(self, in_features: int) -> None:
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double()
        n = x.shape[0]
        self.hessian *= self.rows / (self.rows + n)
        self.rows += n
        x = x * (2.0 / self.rows) ** 0.5
        self.hessian += x.t() @ x


def _group_scales(weight: torch.Tensor, scheme: Scheme, observer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales [N], zero points [N]) of a block of columns [N, G] (one group), by the weight observer;
    the zero points are 0 for a symmetric scheme."""
    obs = make_observer(observer, scheme.weight_range, axis=0)
    obs.observe(weight.float())
    scale, zero_point = obs.qparams()
    return scale.to(weight.dtype), zero_point.to(weight.dtype)


def _inverse_hessian_factor(hessian: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp I)^-1: row i of U, divided by U_ii, is the first row of the
    inverse Hessian of columns i.. (scaled), which is all GPTQ's update needs."""
    h = hessian.clone()
    damp = percdamp * torch.mean(torch.diag(h))
    h += damp * torch.eye(h.shape[0], dtype=h.dtype)
    try:
        factor = torch.linalg.cholesky(h)
        inverse = torch.cholesky_inverse(factor)
        return torch.linalg.cholesky(inverse, upper=True)
    except torch.linalg.LinAlgError:
        raise TesselError(
            "GPTQ: the calibration Hessian is not positive definite even after dampening; "
            "give more --calib-samples or a longer --seq-len"
        ) from None


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, scheme: Scheme, options: GPTQOptions = GPTQOptions()
) -> QuantizedWeight:
    """GPTQ-round a weight [N, K] against the Hessian [K, K] of its input under `scheme`."""
    act_order, observer, block = options.act_order, options.observer, options.block
    n, k = weight.shape
    scheme.check_in_features(k, "a linear layer")
    group = scheme.group_size or k
    if block % group and group % block:
        block = group  # groups must not straddle a lazy block
    dtype = hessian.dtype
    w = weight.detach().to(dtype).clone()
    h = hessian.detach().to(dtype).clone()
    dead = torch.diag(h) == 0  # columns whose input is always zero: any value works, take 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    static_scales = static_zeros = None
    order = torch.arange(k)
    if act_order or options.static_groups:
        params = [_group_scales(w[:, g : g + group], scheme, observer) for g in range(0, k, group)]
        static_scales = torch.stack([p[0] for p in params], dim=1)
        static_zeros = torch.stack([p[1] for p in params], dim=1)
    if act_order:
        order = torch.argsort(torch.diag(h), descending=True, stable=True)
        w, h = w[:, order], h[order][:, order]
    u = _inverse_hessian_factor(h, options.percdamp)
    codes = torch.zeros(n, k, dtype=torch.int8)
    scales = torch.zeros(n, k // group, dtype=dtype) if static_scales is None else static_scales
    zeros = torch.zeros(n, k // group, dtype=dtype) if static_zeros is None else static_zeros
    qrange = scheme.weight_range
    for start in range(0, k, block):
        end = min(start + block, k)
        w_block, u_block = w[:, start:end].clone(), u[start:end, start:end]
        errors = torch.zeros_like(w_block)
        for i in range(end - start):
            column = int(order[start + i])
            if static_scales is None and column % group == 0:
                current = torch.cat([w_block[:, i:], w[:, end:]], dim=1)[:, :group]  # as updated so far
                scales[:, column // group], zeros[:, column // group] = _group_scales(
                    current, scheme, observer
                )
            scale, zero = scales[:, column // group], zeros[:, column // group]
            q = torch.clamp(torch.round(w_block[:, i] / scale) + zero, qrange.qmin, qrange.qmax)  # H's dtype
            codes[:, column] = q.to(torch.int8)
            error = (w_block[:, i] - (q - zero) * scale) / u_block[i, i]
            w_block[:, i:] -= error[:, None] * u_block[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ u[start:end, end:]
    zero_point = None if scheme.symmetric else zeros.to(torch.int8)
    return QuantizedWeight(codes, scales.float(), scheme.group_size, zero_point)


class _StopForward(Exception):
    pass


def _layer_inputs(model: nn.Module, windows: torch.Tensor) -> tuple[list[tuple], list[dict]]:
    """The first decoder layer's positional args per window, and each layer's keyword args (shared by
    the windows; they differ between layers where layer types do: Gemma 3's masks and rotary tables)."""
    layers = model.model.layers
    captured: list[tuple] = []
    kwargs: list[dict] = [{} for _ in layers]

    def catch_first(_module, args, _kw):
        captured.append(tuple(a.detach() if torch.is_tensor(a) else a for a in args))
        if kwargs[-1]:  # every layer's keyword args came with the first window
            raise _StopForward

    def keep(index: int):
        def hook(_module, _args, kw):
            if not kwargs[index]:
                kwargs[index].update(kw)
            if index == len(layers) - 1:
                raise _StopForward

        return hook

    handles = [layers[0].register_forward_pre_hook(catch_first, with_kwargs=True)]
    handles += [layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for window in windows:
            try:
                model(input_ids=window[None], use_cache=False)
            except _StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()
    for kw in kwargs:
        for key in ("past_key_values", "past_key_value", "cache"):
            kw.pop(key, None)
        kw["use_cache"] = False
    return captured, kwargs


def _run_layer(layer: nn.Module, inputs: list[tuple], kwargs: dict) -> list[tuple]:
    outputs = []
    for args in inputs:
        out = layer(*args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        outputs.append((hidden.detach(), *args[1:]))
    return outputs


def _hessians(
    layer: nn.Module, groups: list[tuple[str, ...]], inputs: list[tuple], kwargs: dict
) -> dict[tuple[str, ...], HessianAccumulator]:
    """One Hessian per input group of the layer (an expert's: the rows routed to it), from a forward
    pass over every window."""
    found: dict[tuple[str, ...], HessianAccumulator] = {}
    handles = []
    for names in groups:
        module = layer.get_submodule(names[0])
        acc = found[names] = HessianAccumulator(module.in_features)
        handles.append(module.register_forward_pre_hook(lambda _m, args, acc=acc: acc.add(args[0])))
    try:
        _run_layer(layer, inputs, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return found


@torch.no_grad()
def gptq_model(
    model: nn.Module,
    windows: torch.Tensor,
    scheme: Scheme,
    options: GPTQOptions = GPTQOptions(),
    progress: StepProgress | None = None,
    skip_layers: frozenset[int] = frozenset(),
) -> dict[str, QuantizedWeight]:
    """GPTQ every decoder-layer linear, layer after layer: layer i's Hessians come from the outputs of
    layers 0..i-1 already quantised (their weights replaced in `model` by the rounded ones), as in
    the reference implementation. -> {checkpoint name of the linear: its quantised weight}."""
    inputs, kwargs = _layer_inputs(model, windows)
    layers = model.model.layers
    out: dict[str, QuantizedWeight] = {}
    for index, (layer, layer_map) in enumerate(zip(layers, model_maps(model), strict=True)):
        groups = [] if index in skip_layers else layer_map.input_groups  # kept float: just run
        for names, acc in _hessians(layer, groups, inputs, kwargs[index]).items():
            if acc.rows == 0:  # an expert no calibration token was routed to: round to nearest
                qparams = weight_qparams(options.observer)
                for name in names:
                    weight = layer.get_submodule(name).weight
                    out[f"model.layers.{index}.{name}"] = quantize_weight(weight, scheme, qparams)
                continue
            modules = [layer.get_submodule(name) for name in names]
            stacked = torch.cat([m.weight for m in modules])
            rounded = gptq_quantize(stacked, acc.hessian, scheme, options)
            row = 0
            for name, module in zip(names, modules, strict=True):
                rows = module.out_features
                zero = None if rounded.zero_point is None else rounded.zero_point[row : row + rows]
                part = QuantizedWeight(
                    rounded.q[row : row + rows], rounded.scale[row : row + rows], scheme.group_size, zero
                )
                out[f"model.layers.{index}.{name}"] = part
                module.weight.copy_(part.dequantize().to(module.weight.dtype))
                row += rows
        inputs = _run_layer(layer, inputs, kwargs[index])
        report(progress, "gptq", index + 1, len(layers))
    return out
