"""What the int8 layers (W8A8, W8A16) share: the weight and its scales, and when a path is chosen.

Buffers: weight int8 [N, K], one code row per output channel; weight_scale float32 [N]; bias
float32 [N] or None (weight ~= weight * weight_scale[:, None]). The scales and the bias stay
float32 through `.half()` / `.to(torch.bfloat16)`: rounding a channel's scale to 16 bits would
add a systematic error to each of its outputs, and the kernels take float32 scales anyway.

A layer chooses its path once, from its weight's device and this CPU's features
(`tessel.kernels.cpu_features`), and prepares the weight form that path reads (fbgemm's packed
matrix, a float copy, ...): at construction, on `set_path`, when `.to()` moves the weight and when
`load_state_dict` loads one. A weight edited in place keeps the old forms until `set_path()`.
"""

from __future__ import annotations

import torch
from torch import nn

from tessel.errors import TesselError
from tessel.kernels.quantize_rows import row_codes
from tessel.layers.linear.forms import TracedForms

# Rows up to which a decode step reads the int8 weight directly (GEMV) instead of a GEMM. The
# GEMV re-reads the weight per row, so its lead over the float32 GEMM shrinks with the rows and is
# gone by about 4 (measured over SmolLM2's decoder linears: docs/results.md); each row count is a
# separate compilation (seconds per shape), so only the single-sequence step takes it.
GEMV_MAX_ROWS = 1
WEIGHT_CODE_BITS = (8, 7)  # 7: codes in [-63, 63], which AVX2's fbgemm multiplies by 8-bit activations


def rows_of(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [..., in_features] as rows [M, in_features]; a TesselError for another width."""
    if x.shape[-1] != in_features:
        raise TesselError(f"linear layer expects inputs [..., {in_features}]; got {tuple(x.shape)}")
    return x.reshape(-1, in_features)


def quantize_int8_weight(weight: torch.Tensor, code_bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q [N, K] int8, scale [N] float32), weight ~= q * scale[:, None],
    scale = absmax / 127 (`quantize_per_token` on the weight's rows). code_bits 7: codes in [-63, 63],
    scale absmax / 63 (the rounding of the quantize command's `--weight-code-bits 7`)."""
    if code_bits not in WEIGHT_CODE_BITS:
        raise TesselError(f"weight code bits must be 8 or 7; got {code_bits}")
    with torch.no_grad():
        codes, scale = row_codes(weight.detach().float(), (1 << (code_bits - 1)) - 1)
    return codes.to(torch.int8), scale


class Int8Weights(nn.Module, TracedForms):
    """The int8 weight storage and path bookkeeping of `W8A8Linear` and `W8A16Linear`; a subclass
    says how a path is chosen and prepared (`_prepare`)."""

    FLOAT32_BUFFERS = ("weight_scale", "bias", "input_scale")

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        name = type(self).__name__
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise TesselError(f"{name} wants an int8 weight [N, K]; got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        if self.in_features < 1 or self.out_features < 1:
            raise TesselError(f"{name} sizes must be positive; got {self.in_features} -> {self.out_features}")
        if weight_scale.numel() != self.out_features:
            raise TesselError(f"{name} wants {self.out_features} weight scales; got {weight_scale.numel()}")
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("weight_scale", weight_scale.detach().reshape(-1).float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().reshape(-1).float().contiguous())

    @classmethod
    def from_linear(cls, layer: nn.Linear, weight_code_bits: int = 8):
        """Quantise a float nn.Linear once: per-output-channel int8 weights (codes of
        `weight_code_bits`), float32 scales, float32 bias."""
        weight, scale = quantize_int8_weight(layer.weight, weight_code_bits)
        return cls(weight, scale, None if layer.bias is None else layer.bias.detach().float())

    def _prepare(self) -> None:
        """Choose the path for the weight as it is now and build the weight form it reads."""
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight these int8 values stand for: weight * weight_scale[:, None]."""
        return self.weight.float() * self.weight_scale[:, None]

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        """Follow .to(device) / .cuda() (choosing the path again for a moved weight), but keep the
        scales and the bias float32 through .half() / .to(bf16)."""
        before = self.weight
        kept = {
            name: self._buffers[name] for name in self.FLOAT32_BUFFERS if self._buffers.get(name) is not None
        }
        for name in kept:
            self._buffers[name] = None
        super()._apply(fn, recurse)
        for name, tensor in kept.items():  # the int8 weight has moved to the new device by now
            self._buffers[name] = tensor.to(device=self.weight.device, dtype=torch.float32)
        if self.weight is not before:
            self._prepare()
        return self

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # type: ignore[override]
        super()._load_from_state_dict(*args, **kwargs)
        self._prepare()  # the loaded weight's path and forms
