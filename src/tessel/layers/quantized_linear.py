"""The engine's W8A8 linear: int8 weights per output channel, int8 activations, one int8 GEMM.

    dynamic:  (q_x, s_x) = quantize_per_token(x)                  s_x [M], one scale per token
    static:   q_x = clamp(round(x / s_in), -127, 127), s_x = s_in  s_in: the calibrated input_scale
    y = (q_x @ q_w.T) * s_x[:, None] * s_w[None, :] + bias

On CUDA the GEMM is tessel's Triton int8 kernel. On CPU the path follows the CPU
(`tessel.quant.cpu_features`): `int_mm` (AVX-512 VNNI / AMX: `torch._int_mm`), `fbgemm` (AVX2:
PyTorch's dynamic int8 linear, which quantises the activations per tensor, not per token, and
uses 7-bit activations against int16 saturation; static scales fall back to `dequant` there),
`dequant` (the integer products as a float32 GEMM).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from tessel.errors import TesselError
from tessel.kernels.int8_gemm import int8_gemm
from tessel.kernels.quantize import QMAX, quantize_per_token
from tessel.quant.cpu_features import INT8_PATHS, choose_int8_path


class W8A8Linear(nn.Module):
    """y = x @ (q_w * s_w[:, None]).T + bias with x quantised to int8 per token (or by a static scale)."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__()
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise TesselError(
                f"W8A8Linear wants an int8 weight [N, K]; got {weight.dtype} {tuple(weight.shape)}"
            )
        self.out_features, self.in_features = weight.shape
        if weight_scale.numel() != self.out_features:
            raise TesselError(
                f"W8A8Linear wants {self.out_features} weight scales; got {weight_scale.numel()}"
            )
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.reshape(-1).float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.reshape(-1).float().contiguous())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.reshape(1).float())
        self.set_path(path)

    def set_path(self, path: str | None = None) -> None:
        """Pick the CPU int8 path (None: by this CPU's features) and prepare its weight form."""
        path = choose_int8_path() if path is None else path
        if path not in INT8_PATHS:
            raise TesselError(f"unknown int8 path {path!r}; choose one of {', '.join(INT8_PATHS)}")
        if path == "fbgemm" and self.input_scale is not None:
            path = "dequant"  # fbgemm's dynamic linear cannot take a calibrated input scale
        self.path = path
        self._packed = self._float_weight = None
        if self.weight.device.type != "cpu" or self.weight.is_meta:
            return
        if path == "fbgemm":
            self._packed = _fbgemm_pack(self.weight, self.weight_scale, self.bias)
        elif path == "dequant":
            self._float_weight = self.weight.float()

    def _quantize_input(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_scale is None:
            return quantize_per_token(rows)
        s = self.input_scale
        q = torch.round(rows.float() / s).clamp_(-QMAX, QMAX).to(torch.int8)
        return q, s.expand(rows.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.is_cuda or self.path == "int_mm":
            q, s = self._quantize_input(rows)
            out = int8_gemm(q, self.weight, s, self.weight_scale, self.bias, out_dtype=x.dtype)
        elif self.path == "fbgemm":
            out = torch.ops.quantized.linear_dynamic(rows.float(), self._packed, True).to(x.dtype)
        else:
            q, s = self._quantize_input(rows)
            out = (q.float() @ self._float_weight.t()).mul_(s[:, None]).mul_(self.weight_scale)
            out = (out if self.bias is None else out.add_(self.bias)).to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        act = "dynamic per token" if self.input_scale is None else "static per tensor"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, act={act}, path={self.path}"
        )


def _fbgemm_pack(weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    zeros = torch.zeros(weight.shape[0], dtype=torch.int64)
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch; fbgemm still needs one
        warnings.simplefilter("ignore")
        torch.backends.quantized.engine = "fbgemm"
        qweight = torch._make_per_channel_quantized_tensor(weight, scale.double(), zeros, 0)
        return torch.ops.quantized.linear_prepack(qweight, bias)


def dequantized_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    """A float nn.Linear holding the dequantised weight (weight-only schemes on CPU)."""
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=dtype)
    layer.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return layer
