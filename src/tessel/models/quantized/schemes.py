"""Quantisation schemes and weight quantisation (per output channel, or per group of input columns).

    w8a8:   int8 weights per output channel, int8 activations (dynamic per token, or static per tensor)
    w8a16:  int8 weights per output channel, float activations
    w4a16:  int4 weights per group of GROUP_SIZE input columns, float activations

Weights are symmetric by default (zero point 0), so W ~= q * scale with scale [N, groups] broadcast
over the columns of each group: the layout of compressed-tensors' `weight_scale`. Weight-only schemes
can be asymmetric (`--asym`, llm-compressor's W4A16_ASYM): W ~= (q - zero_point) * scale with an
integer zero point per scale, from compressed-tensors' rule (the range [min(lo, 0), max(hi, 0)]
over the qmin..qmax levels, zero_point = clamp(qmin - round(lo / scale))).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tessel.errors import TesselError
from tessel.models.quantized.qparams import NARROW_CODE_BITS, QuantRange, calculate_qparams, quantize_tensor

GROUP_SIZE = 128  # the group of llm-compressor's W4A16 preset (and GPTQ's usual one)
# (scale, zero_point) of each row of a weight [R, G] in a range: round to nearest takes every row's
# min and max (`row_minmax_qparams`); the offline toolkit's clip searches are its weight observers
WeightQParams = Callable[[torch.Tensor, QuantRange], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class Scheme:
    name: str
    weight_bits: int
    group_size: int | None  # None: one scale per output channel
    act_bits: int | None  # None: weight-only (float activations)
    act_static: bool = False  # activations: static per tensor (calibrated) vs dynamic per token
    symmetric: bool = True  # False: weights with a zero point per scale (weight-only schemes)
    weight_code_bits: int | None = None  # w8a8: 7 keeps the int8 codes in [-63, 63] (AVX2's fbgemm)
    float_linears: frozenset[str] = frozenset()  # a checkpoint's decoder-layer linears left float (`ignore`)

    @property
    def weight_range(self) -> QuantRange:
        """int8: [-127, 127] ([-63, 63] with 7-bit codes); int4: every level of [-8, 7] with scale
        max|w| / 7.5 (compressed-tensors' and llm-compressor's symmetric int4): one level more than
        [-7, 7] is worth much at 4 bits. Asymmetric: every level of [-2**(b-1), 2**(b-1) - 1]."""
        restricted = self.weight_bits == 8 and self.symmetric
        return QuantRange(
            self.weight_bits, symmetric=self.symmetric, restricted=restricted, code_bits=self.weight_code_bits
        )

    @property
    def weight_only(self) -> bool:
        return self.act_bits is None

    def check_in_features(self, in_features: int, where: str) -> None:
        if self.group_size is not None and in_features % self.group_size:
            raise TesselError(
                f"scheme {self.name}: group size {self.group_size} does not divide in_features "
                f"{in_features} of {where}; choose --group-size dividing it"
            )


def make_scheme(
    name: str,
    act: str = "dynamic",
    group_size: int | None = None,
    symmetric: bool = True,
    weight_code_bits: int = 8,
) -> Scheme:
    """The scheme for `--scheme NAME --act dynamic|static [--group-size G] [--asym]
    [--weight-code-bits 7]`."""
    if weight_code_bits not in (8, *NARROW_CODE_BITS):
        raise TesselError(f"--weight-code-bits must be 8 or 7; got {weight_code_bits}")
    if weight_code_bits != 8 and name != "w8a8":
        raise TesselError(
            "--weight-code-bits 7 applies to w8a8 (int8 x int8 on AVX2); weight-only schemes keep 8-bit codes"
        )
    if not symmetric and name == "w8a8":
        raise TesselError("--asym applies to weight-only schemes (w8a16, w4a16); w8a8 weights are symmetric")
    if act not in ("dynamic", "static"):
        raise TesselError(f"--act must be dynamic or static; got {act!r}")
    if name == "w8a8":
        if group_size is not None:
            raise TesselError(
                "--group-size applies to w8a16 / w4a16; w8a8 weights have a scale per output channel"
            )
        narrow = None if weight_code_bits == 8 else weight_code_bits
        return Scheme(name, 8, None, 8, act_static=act == "static", weight_code_bits=narrow)
    if act == "static":
        raise TesselError(f"--act static needs quantised activations; scheme {name} keeps them float")
    if name == "w8a16":
        return Scheme(name, 8, group_size, None, symmetric=symmetric)
    if name == "w4a16":
        return Scheme(name, 4, group_size or GROUP_SIZE, None, symmetric=symmetric)
    raise TesselError(f"unknown --scheme {name!r}; choose w8a8, w8a16 or w4a16")


@dataclass(slots=True)
class QuantizedWeight:
    """q int8 [N, K] (int4 values sit in [-8, 7]); scale float32 [N, groups]; zero_point None
    (symmetric) or int8 [N, groups]; W ~= (q - zero_point) * scale per group."""

    q: torch.Tensor
    scale: torch.Tensor
    group_size: int | None
    zero_point: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        return dequantize_weight(self.q, self.scale, self.group_size, self.zero_point)


def _grouped(weight: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """[N, K] -> [N * groups, G] rows, one per scale."""
    n, k = weight.shape
    return weight.reshape(n, 1, k) if group_size is None else weight.reshape(n, k // group_size, group_size)


def row_minmax_qparams(rows: torch.Tensor, qrange: QuantRange) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero_point) [R] of each row of `rows` [R, G] from its min and max (the minmax observer's,
    per row: no clipping)."""
    lo, hi = torch.aminmax(rows.float(), dim=1)
    return calculate_qparams(lo, hi, qrange)


def quantize_weight(
    weight: torch.Tensor, scheme: Scheme, qparams: WeightQParams = row_minmax_qparams
) -> QuantizedWeight:
    """Round-to-nearest quantisation of an nn.Linear weight [N, K] under `scheme` (its symmetry), with
    the scale and zero point of each row (or group) that `qparams` gives: its min and max by default."""
    weight = weight.detach().float()
    n, k = weight.shape
    if weight.numel() == 0:
        raise TesselError(f"a linear layer's weight [{n}, {k}] is empty; there is nothing to quantise")
    scheme.check_in_features(k, "a linear layer")
    rows = _grouped(weight, scheme.group_size)
    groups = rows.shape[1]
    scale, zero_point = qparams(rows.reshape(n * groups, -1), scheme.weight_range)
    scale, zero_point = scale.view(n, groups, 1), zero_point.view(n, groups, 1)
    q = quantize_tensor(rows, scale, zero_point, scheme.weight_range).reshape(n, k)
    zero = None if scheme.symmetric else zero_point.view(n, groups).to(torch.int8)
    return QuantizedWeight(q, scale.view(n, groups), scheme.group_size, zero)


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, group_size: int | None, zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    """(q [N, K] - zero_point [N, groups]) * scale [N, groups], spread over each group's columns ->
    float32 [N, K]."""
    n, k = q.shape
    rows = _grouped(q.float(), group_size if scale.shape[1] > 1 else None)
    if zero_point is not None:
        rows = rows - zero_point.float().view(n, -1, 1)
    return (rows * scale.float().view(n, -1, 1)).reshape(n, k)
