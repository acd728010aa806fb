"""Integer ranges and quantisation parameters: the arithmetic that the runtime and the offline toolkit share.

    symmetric:   scale = max(|lo|, |hi|) / ((qmax - qmin) / 2),  zero_point = 0
    asymmetric:  scale = (hi - lo) / (qmax - qmin),  zero_point = clamp(qmin - round(lo / scale), qmin, qmax)
    q = clamp(round(x / scale) + zero_point, qmin, qmax),  x ~= (q - zero_point) * scale

with lo <= 0 <= hi (zero is always representable) and scale >= float32 eps: the same arithmetic,
bit for bit, as `torch.ao.quantization`'s observers (tests hold them to it). Symmetric ranges are
restricted (int8: [-127, 127], int4: [-7, 7]) so -x quantises to -q, unless `restricted=False`:
then, as compressed-tensors does, scale = max|x| / 7.5 (int4) over all of [-8, 7]; asymmetric ranges
use every level (int8: [-128, 127], int4: [-8, 7]).

How a clip range (lo, hi) is found is the offline toolkit's (`tessel.quant.observers`); load-time
rounding takes each row's min and max (`tessel.models.quantized.schemes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessel.errors import TesselError

FLOAT32_EPS = torch.finfo(torch.float32).eps  # torch.ao's smallest scale
NARROW_CODE_BITS = (7,)  # QuantRange.code_bits allowed below num_bits


@dataclass(frozen=True, slots=True)
class QuantRange:
    """Integer width and mapping: int8 / int4, symmetric (zero point 0) or asymmetric.

    `code_bits` narrows the codes of a symmetric int8 range while they are still stored as int8:
    7 keeps them in [-63, 63], which AVX2's int8 multiply-add cannot saturate against 8-bit
    activations (`tessel.kernels.int8_cpu`)."""

    num_bits: int = 8
    symmetric: bool = True
    restricted: bool = True  # symmetric: drop the lowest level (-2**(b-1)) so -x quantises to -q
    code_bits: int | None = None  # None: num_bits

    def __post_init__(self) -> None:
        if self.num_bits not in (4, 8):
            raise TesselError(f"num_bits must be 4 or 8; got {self.num_bits}")
        if self.code_bits is not None and (
            self.code_bits not in NARROW_CODE_BITS or self.num_bits != 8 or not self.symmetric
        ):
            raise TesselError(f"code_bits {self.code_bits} applies to symmetric int8 only; choose 7")

    @property
    def _bits(self) -> int:
        return self.num_bits if self.code_bits is None else self.code_bits

    @property
    def qmin(self) -> int:
        half = 1 << (self._bits - 1)
        return -(half - 1) if self.symmetric and self.restricted else -half

    @property
    def qmax(self) -> int:
        return (1 << (self._bits - 1)) - 1


def calculate_qparams(
    lo: torch.Tensor, hi: torch.Tensor, qrange: QuantRange
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale float32, zero_point int32) from a clip range, as torch.ao computes them (qint8)."""
    lo, hi = lo.float(), hi.float()
    lo_neg = torch.min(lo, torch.zeros_like(lo))
    hi_pos = torch.max(hi, torch.zeros_like(hi))
    eps = torch.tensor(FLOAT32_EPS, device=lo.device)
    qmin, qmax = qrange.qmin, qrange.qmax
    if qrange.symmetric:
        scale = torch.max(torch.max(-lo_neg, hi_pos) / (float(qmax - qmin) / 2), eps)
        zero_point = torch.zeros(scale.shape, dtype=torch.int32, device=lo.device)
    else:
        scale = torch.max((hi_pos - lo_neg) / float(qmax - qmin), eps)
        zero_point = torch.clamp(qmin - torch.round(lo_neg / scale).to(torch.int), qmin, qmax)
    return scale.reshape(lo.shape), zero_point.to(torch.int32).reshape(lo.shape)


def quantize_tensor(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qrange: QuantRange
) -> torch.Tensor:
    """q = clamp(round(x / scale) + zero_point, qmin, qmax) as int8 (scale broadcasts against x)."""
    q = torch.round(x.float() / scale) + zero_point
    return q.clamp_(qrange.qmin, qrange.qmax).to(torch.int8)


def dequantize_tensor(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    return (q.float() - zero_point) * scale
