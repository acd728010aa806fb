"""W8A16 on CPU: int8 weights per output channel, float activations, no float copy of the weight read.

    out[m, n] = (sum_k x[m, k] * w[n, k]) * w_scale[n] + bias[n]         float32 sums

`gemv_int8` is that formula as one fused reduction compiled by inductor (its C++ codegen, called
without torch.compile's guards): each int8 weight is converted in registers, so a decode step
reads 1 byte per weight instead of the 4 of a float32 GEMM. It wins only for a few rows (a decode
step of one or two sequences, where the GEMM is memory-bound): at more rows the weight is re-read
per row, and the caller runs a library GEMM instead (`tessel.layers.linear.W8A16Linear`).
Measured in benchmarks/quant.py (`--only gemm`); compile time is paid once per process
(inductor caches the generated code on disk across processes).

`bf16_gemm` is the bfloat16-activation path (W8A16 as a GPU runs it: 16-bit activations):
`torch._weight_int8pack_mm` for a few rows, oneDNN's bfloat16 GEMM on the int8 values held as
bfloat16 (exact: |w| <= 127) for more, float32 sums rounded to bfloat16, the scale in float32.
"""

from __future__ import annotations

import functools

import torch

from tessel.kernels import cpu_compile
from tessel.kernels.cpu_compile import compiler_available
from tessel.kernels.quantize_rows import per_token_codes

# torch 2.13's CPU `_weight_int8pack_mm` is right only when K is a multiple of 16: it crashed
# (segfault) at K = 66 and 70 and returned wrong values or NaN at K = 36, 68, 72 (32, 48, 80, 576
# and 1536 were right); other layers take the bfloat16 GEMM, which computes the same.
INT8PACK_K_MULTIPLE = 16


def gemv_formula(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """W8A16's product: float32 rows times the int8 weight, summed in float32, times the channel scale."""
    return (x[:, None, :] * w[None].to(torch.float32)).sum(-1) * w_scale


def gemv_bias_formula(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    return (x[:, None, :] * w[None].to(torch.float32)).sum(-1) * w_scale + bias


def gemv_scaled_formula(
    codes: torch.Tensor, w: torch.Tensor, row_scale: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """W8A8's one-row product: integer codes summed in float32, then `int8_epilogue`'s two scalings
    in its order (bit-equal to it; a bias is added outside, as a fused add-multiply was not)."""
    acc = (codes[:, None, :] * w[None].to(torch.float32)).sum(-1)
    return (acc * row_scale[:, None]) * w_scale


# kernel name -> (function, its example inputs for M, N, K)
_KERNELS = {
    "gemv": (gemv_formula, lambda m, n, k: [_x(m, k), _w(n, k), torch.zeros(n)]),
    "gemv_bias": (gemv_bias_formula, lambda m, n, k: [_x(m, k), _w(n, k), torch.zeros(n), torch.zeros(n)]),
    "gemv_scaled": (
        gemv_scaled_formula,
        lambda m, n, k: [_x(m, k), _w(n, k), torch.zeros(m), torch.zeros(n)],
    ),
    "quantize": (per_token_codes, lambda m, n, k: [_x(m, k)]),
}


def _x(m: int, k: int) -> torch.Tensor:
    return torch.zeros(m, k)


def _w(n: int, k: int) -> torch.Tensor:
    return torch.zeros(n, k, dtype=torch.int8)


@functools.cache
def _compiled(name: str, m: int, n: int, k: int):
    """A static-shape compiled kernel per shape (a static GEMV ran faster than a dynamic-shape one
    at SmolLM2's shapes); `tessel.kernels.cpu_compile` builds it."""
    fn, example = _KERNELS[name]
    return cpu_compile.compile_graph(fn, example(m, n, k))


def _run(key: tuple[str, int, int, int], args: list[torch.Tensor]):
    """The compiled kernel of `key` on `args`; None when compiling fails (a warning, once)."""
    return cpu_compile.run(lambda: _compiled(*key), args, "the compiled W8A16 GEMV", "the float GEMM")


def gemv_int8(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """x float32 [M, K] @ (w int8 [N, K] * w_scale [N]).T + bias -> float32 [M, N], fused and compiled;
    None when compiling fails (the caller falls back; a warning says why, once per process)."""
    if not compiler_available():
        return None
    if x.dtype != torch.float32 or w.dtype != torch.int8 or x.device.type != "cpu":
        return None
    args = [x.contiguous(), w.contiguous(), w_scale.float().contiguous()]
    if bias is not None:
        args.append(bias.float().contiguous())
    return _run(("gemv" if bias is None else "gemv_bias", x.shape[0], w.shape[0], w.shape[1]), args)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`quantize_per_token(x)` for a float32 CPU x [M, K] as one compiled kernel, the codes as
    float32 [M, K] (integers in [-127, 127]) and the scales [M]; None without a compiler."""
    if not compiler_available() or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    return _run(("quantize", x.shape[0], 0, x.shape[1]), [x.contiguous()])


def gemv_int8_scaled(
    codes: torch.Tensor, w: torch.Tensor, row_scale: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor | None:
    """(codes float32 [M, K] @ w int8 [N, K].T) * row_scale[:, None] * w_scale[None, :], float32 sums
    of the integer products, as one compiled kernel; None without a compiler."""
    if not compiler_available() or codes.dtype != torch.float32 or w.dtype != torch.int8:
        return None
    args = [codes.contiguous(), w.contiguous(), row_scale.float().contiguous(), w_scale.float().contiguous()]
    return _run(("gemv_scaled", codes.shape[0], w.shape[0], w.shape[1]), args)


def bf16_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    w16: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    gemv_max_rows: int,
) -> torch.Tensor:
    """bf16(sum_k bf16(x[m, k]) * w[n, k]) * w_scale[n] + bias[n] -> float32 [M, N] (sums in float32).

    Up to `gemv_max_rows` rows: `torch._weight_int8pack_mm` on the int8 weight (unit scales, so the
    scale is applied in float32 as below); more rows: a bfloat16 GEMM on `w16`, the weight as
    bfloat16 [N, K] or reordered for oneDNN (`torch.ops.mkldnn._reorder_linear_weight`).
    Both round the sum to bfloat16, as a bfloat16 GEMM's output is."""
    xb = x.to(torch.bfloat16)
    if x.shape[0] <= gemv_max_rows and x.shape[1] % INT8PACK_K_MULTIPLE == 0:
        out = torch.ops.aten._weight_int8pack_mm(xb, w, _unit_scales(w.shape[0]))
    elif w16.is_mkldnn:
        out = torch.ops.mkldnn._linear_pointwise(xb, w16, None, "none", [], "")
    else:
        out = torch.matmul(xb, w16.t())
    out = out.float().mul_(w_scale)
    return out if bias is None else out.add_(bias)


@functools.lru_cache(maxsize=64)
def _unit_scales(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bfloat16)
