"""W8A16 GEMM: float activations x int8 weights dequantised inside the kernel.

    out[m, n] = sum_k x[m, k] * (w[n, k] * w_scale[n]) + bias[n]
              = (sum_k x[m, k] * w[n, k]) * w_scale[n] + bias[n]

Each int8 weight tile is converted to the activation dtype in registers (exact: |w| <= 127 fits
float16 and bfloat16), multiplied on the tensor cores with float32 accumulation, and the
per-channel scale is applied once per output in the epilogue. Weights cross memory as int8:
half the bytes of an fp16 GEMM, which is what decode (small M, memory-bound) pays for.

Triton 3.9's interpreter multiplies bfloat16 tiles as their raw 16-bit patterns (np.matmul on
uint16), so under TRITON_INTERPRET=1 a bfloat16 dot runs in float32 instead (`_utils.float_dot`);
compiled kernels use the native bfloat16 dot.

The kernel is `tessel.kernels.gemm`'s; with float weights and no scale it is `linear`, the GEMM
behind `tessel.layers.Linear`.
"""

from __future__ import annotations

import torch

from tessel.errors import TesselError
from tessel.kernels._utils import FLOAT_DTYPES, float_dot
from tessel.kernels.autotune import FLOAT_GEMM_CONFIGS, INTERPRETER_CONFIG, Autotuner, bucket_m, shape_key
from tessel.kernels.dispatch import use_triton
from tessel.kernels.gemm import gemm_triton

_TUNERS = {
    "w8a16_gemm": Autotuner("w8a16_gemm", FLOAT_GEMM_CONFIGS, default=INTERPRETER_CONFIG),
    "linear": Autotuner("linear", FLOAT_GEMM_CONFIGS, default=INTERPRETER_CONFIG),
}


def _mixed_gemm_triton(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    (M, K), N = x.shape, w.shape[0]
    name = "w8a16_gemm" if w_scale is not None else "linear"
    key = shape_key(m=bucket_m(M), n=N, k=K, x=str(x.dtype).removeprefix("torch."), bias=bias is not None)
    return gemm_triton(x, w, None, w_scale, bias, x.dtype, float_dot(x.dtype), _TUNERS[name], key)


# Weight rows dequantised per step of the PyTorch path: 2**24 float32 elements (64 MiB) bound the
# transient float copy (a 28672 x 8192 weight would otherwise need 940 MiB per call) while keeping
# the number of separate ops small (on a loaded 2-core machine every extra parallel op risked a
# scheduler stall: 4 MiB blocks ran several times slower at 2 threads; docs/results.md).
DEQUANT_CHUNK_ELEMENTS = 1 << 24


def _w8a16_gemm_torch(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # Dequantise a block of weight rows at a time and hand it to the library GEMM. On CPU this
    # saves memory, not time: torch's own int8-weight CPU kernel (torch._weight_int8pack_mm)
    # is far slower than fp32 F.linear (docs/results.md).
    n, k = w.shape
    rows = max(16, DEQUANT_CHUNK_ELEMENTS // max(k, 1))
    scale = w_scale.view(-1, 1).float()
    parts = []
    for start in range(0, n, rows):
        block = w[start : start + rows].float().mul_(scale[start : start + rows])
        parts.append(x @ block.to(x.dtype).t())
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out if bias is None else out.add_(bias.to(x.dtype))


def _check_x(name: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise TesselError(f"{name} wants x [M, K] and w [N, K]; got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TesselError(f"{name} wants a float16/bfloat16/float32 x; got {x.dtype}")
    if bias is not None and bias.shape != (w.shape[0],):
        raise TesselError(f"{name} wants bias [{w.shape[0]}]; got {tuple(bias.shape)}")


def _empty_sum(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.zeros((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    return out if bias is None else out.add_(bias.to(x.dtype))


def w8a16_gemm(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ (w * w_scale[:, None]).T + bias, with the int8 weights dequantised inside the kernel.

    x: float16 / bfloat16 / float32 [M, K]; w: int8 [N, K]; w_scale: float [N]; bias: [N] or None.
    Returns x.dtype [M, N]; float32 accumulation.
    """
    _check_x("w8a16_gemm", x, w, bias)
    if w.dtype != torch.int8:
        raise TesselError(f"w8a16_gemm wants an int8 w; got {w.dtype}")
    if w_scale.shape != (w.shape[0],) or not w_scale.is_floating_point():
        raise TesselError(f"w8a16_gemm wants a float w_scale [{w.shape[0]}]; got {tuple(w_scale.shape)}")
    if x.numel() == 0 or w.numel() == 0:
        return _empty_sum(x, w, bias)
    if use_triton(x, w, w_scale):
        return _mixed_gemm_triton(x, w, w_scale, bias)
    return _w8a16_gemm_torch(x, w, w_scale, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias for float x [M, K] and weight [N, K] of the same dtype (nn.functional.linear)."""
    _check_x("linear", x, weight, bias)
    if weight.dtype != x.dtype:
        raise TesselError(f"linear wants weight in x's dtype {x.dtype}; got {weight.dtype}")
    if x.numel() == 0 or weight.numel() == 0:
        return _empty_sum(x, weight, bias)
    if use_triton(x, weight):
        return _mixed_gemm_triton(x, weight, None, bias)
    return torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))
