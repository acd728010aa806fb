"""W8A16: int8 weights per output channel, float activations. The engine's layer for per-channel
symmetric w8a16 checkpoints (CUDA, and CPU in float32), and the int8 LM head of float and
weight-only models.

    y = x @ (q_w * s_w[:, None]).T + bias = (x @ q_w.T) * s_w + bias

On CUDA (or with Triton forced) the path is `w8a16_gemm` (tessel's kernel: the int8 weight
de-quantised inside the GEMM), in the input's dtype. On CPU it follows the CPU
(`tessel.kernels.cpu_features.choose_w8a16_path`), chosen once, float32 sums rounded once to the
input's dtype:

    gemv       rows <= GEMV_MAX_ROWS: y = gemv_int8(x, q_w, s_w, bias), compiled (int8 weights read);
               more rows: the de-quantised float32 GEMM (oneDNN-packed), as `dequant`; the one row
               is also the layer's traced form (`one_row_form`)
    fp16codes  y = fp16_codes_linear(x, q_w as float16, s_w, bias) (float32 sums, 2 bytes per weight)
    bf16       y = bf16(sum_k bf16(x) * q_w) * s_w + bias (int8 weights for few rows, packed bf16 above)
    dequant    the de-quantised float32 GEMM for every call
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tessel.errors import TesselError
from tessel.kernels.cpu_features import W8A16_PATHS, choose_w8a16_path
from tessel.kernels.dispatch import use_triton
from tessel.kernels.int8_cpu import FP16Codes, fp16_codes_linear, fp16_codes_pack
from tessel.kernels.w8a16_cpu import bf16_gemm, gemv_int8
from tessel.kernels.w8a16_gemm import w8a16_gemm
from tessel.layers.linear.dense import onednn_weight, packed_linear, packing_available
from tessel.layers.linear.forms import LinearForm
from tessel.layers.linear.int8_weights import GEMV_MAX_ROWS, Int8Weights, rows_of

GPU_PATH = "w8a16_gemm"


@dataclass(frozen=True, slots=True)
class W8A16Path:
    """The path a W8A16 layer takes, and the weight forms it reads besides the int8 one."""

    name: str  # one of W8A16_PATHS on CPU, GPU_PATH on CUDA (or with Triton forced)
    fp16_codes: FP16Codes | None = None  # fp16codes: fbgemm's float16 form of the codes
    bf16_weight: torch.Tensor | None = None  # bf16: the codes as bfloat16 (oneDNN-packed where it can)
    dense: Callable[[torch.Tensor], torch.Tensor] | None = None  # gemv, dequant: the float32 GEMM


class W8A16Linear(Int8Weights):
    """y = x @ (q_w * s_w[:, None]).T + bias, the int8 weight never copied to float per call."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        path: str | None = None,
    ) -> None:
        super().__init__(weight, weight_scale, bias)
        self.set_path(path)

    def set_path(self, path: str | None = None) -> None:
        """Force a CPU path (one of W8A16_PATHS), or None: by this CPU (TESSEL_W8A16_PATH forces
        one); the weight form it reads besides the int8 one is built now."""
        if path is not None and path not in W8A16_PATHS:
            raise TesselError(f"unknown W8A16 path {path!r}; choose one of {', '.join(W8A16_PATHS)}")
        self._forced = path
        self._prepare()

    def _prepare(self) -> None:
        w = self.weight
        if w.is_meta or w.is_cuda or use_triton(w):
            self.plan = W8A16Path(GPU_PATH)
            return
        path = self._forced or choose_w8a16_path()
        if path == "fp16codes":
            self.plan = W8A16Path(path, fp16_codes=fp16_codes_pack(w))
        elif path == "bf16":
            w16 = w.to(torch.bfloat16)
            self.plan = W8A16Path(path, bf16_weight=onednn_weight(w16) if packing_available() else w16)
        else:
            dense = w.float().mul_(self.weight_scale[:, None])
            if packing_available():
                self.plan = W8A16Path(path, dense=packed_linear(dense, self.bias))
            else:
                self.plan = W8A16Path(path, dense=functools.partial(F.linear, weight=dense, bias=self.bias))

    @property
    def path(self) -> str:
        return self.plan.name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        if plan.name == GPU_PATH:
            out = w8a16_gemm(rows_of(x, self.in_features), self.weight, self.weight_scale, self.bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        decode_step = x.dim() == 2 and x.dtype == torch.float32 and 0 < x.shape[0] <= GEMV_MAX_ROWS
        if plan.name == "gemv" and decode_step:
            out = gemv_int8(x, self.weight, self.weight_scale, self.bias)  # a decode step: the hot path
            if out is not None:
                return out
        rows = rows_of(x, self.in_features).float()
        out = None
        if plan.name == "fp16codes":
            out = fp16_codes_linear(rows, plan.fp16_codes, self.weight_scale, self.bias)
        elif plan.name == "bf16":
            out = bf16_gemm(rows, self.weight, plan.bf16_weight, self.weight_scale, self.bias, GEMV_MAX_ROWS)
        elif plan.name == "gemv" and 0 < rows.shape[0] <= GEMV_MAX_ROWS:
            out = gemv_int8(rows, self.weight, self.weight_scale, self.bias)
        if out is None:
            out = plan.dense(rows)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def one_row_form(self) -> LinearForm | None:
        """The compiled GEMV's formula on the `gemv` path; None on the others (library GEMMs)."""
        if self.plan.name != "gemv":
            return None
        return LinearForm("w8a16", (self.weight, self.weight_scale), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, path={self.path}"
