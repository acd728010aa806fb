"""2-D convolution (NCHW) as an implicit GEMM: no im2col buffer is ever written.

    out[n, o, p, q] = bias[o] + sum_{c, i, j} x[n, g*Cg + c, p*sh - ph + i*dh, q*sw - pw + j*dw]
                                             * w[o, c, i, j]          (o in group g, Cg = C / groups)

Seen as a GEMM per group: rows m = (n, p, q) output pixels, columns o = output channels,
reduction k = (c, i, j). Each program computes a BLOCK_M x BLOCK_N output tile; for every K step
it computes the input coordinates of its rows on the fly, gathers that x tile straight from the
NCHW tensor (out-of-image taps masked to the zero padding) and multiplies it with a weight tile,
accumulating in float32.
"""

from __future__ import annotations

import torch

from tessel.errors import TesselError
from tessel.kernels import _utils
from tessel.kernels._utils import FLOAT_DTYPES, dot_acc, float_dot, grouped_tile, tl, triton
from tessel.kernels.autotune import (
    CONV_CONFIGS,
    INTERPRETER_CONFIG,
    Autotuner,
    TileConfig,
    launch_tuned,
    shape_key,
)
from tessel.kernels.dispatch import use_triton

if triton is not None:

    @triton.jit
    def _conv2d_kernel(
        X_ptr,
        W_ptr,
        Out_ptr,
        Bias_ptr,
        H,
        W,
        OH,
        OW,
        M,
        OC_g,
        C_g,
        K,
        x_n_stride,
        x_c_stride,
        x_h_stride,
        x_w_stride,
        w_o_stride,
        w_c_stride,
        w_h_stride,
        w_w_stride,
        out_n_stride,
        out_c_stride,
        out_h_stride,
        out_w_stride,
        stride_h,
        stride_w,
        pad_h,
        pad_w,
        dil_h,
        dil_w,
        KH: tl.constexpr,
        KW: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        DOT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        # Rows: output pixels (n, p, q). Columns: output channels of this group.
        rows, cols = grouped_tile(tl.program_id(0).to(tl.int64), M, OC_g, BLOCK_M, BLOCK_N, GROUP_M)
        group = tl.program_id(1).to(tl.int64)
        rows_in = rows % M
        cols_in = cols % OC_g
        n = rows_in // (OH * OW)
        pix = rows_in % (OH * OW)
        ih0 = (pix // OW) * stride_h - pad_h
        iw0 = (pix % OW) * stride_w - pad_w
        x_base = X_ptr + n * x_n_stride + group * C_g * x_c_stride
        oc = group * OC_g + cols_in
        w_base = W_ptr + oc * w_o_stride

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            c = ks // (KH * KW)
            tap = ks % (KH * KW)
            kh = tap // KW
            kw = tap % KW
            ih = ih0[:, None] + kh[None, :] * dil_h
            iw = iw0[:, None] + kw[None, :] * dil_w
            x_mask = k_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            x_ptrs = x_base[:, None] + c[None, :] * x_c_stride + ih * x_h_stride + iw * x_w_stride
            x = tl.load(x_ptrs, mask=x_mask, other=0.0)
            w_off = c * w_c_stride + kh * w_h_stride + kw * w_w_stride
            w = tl.load(w_base[None, :] + w_off[:, None], mask=k_ok[:, None], other=0.0)
            acc = dot_acc(x, w, acc, DOT)

        if HAS_BIAS:
            acc += tl.load(Bias_ptr + oc).to(tl.float32)[None, :]
        out_row = n * out_n_stride + (pix // OW) * out_h_stride + (pix % OW) * out_w_stride
        out_ptrs = Out_ptr + out_row[:, None] + oc[None, :] * out_c_stride
        tl.store(
            out_ptrs, acc.to(Out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < OC_g)
        )


_TUNER = Autotuner("conv2d", CONV_CONFIGS, default=INTERPRETER_CONFIG)


def _pair(value: int | tuple[int, ...], name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) for v in pair):
        raise TesselError(f"conv2d {name} must be an int or a pair of ints; got {value!r}")
    return pair  # type: ignore[return-value]


def _conv2d_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    groups: int,
    out_hw: tuple[int, int],
) -> torch.Tensor:
    batch, channels, height, width = x.shape
    out_channels, c_g, kh, kw = w.shape
    oh, ow = out_hw
    out = _utils.empty_output((batch, out_channels, oh, ow), x.dtype, x.device)
    m = batch * oh * ow
    oc_g = out_channels // groups
    k = c_g * kh * kw
    bias = bias.contiguous() if bias is not None else None
    bias_arg = bias if bias is not None else out  # never read when HAS_BIAS=False

    def launch(config: TileConfig) -> None:
        grid = (triton.cdiv(m, config.block_m) * triton.cdiv(oc_g, config.block_n), groups)
        _conv2d_kernel[grid](
            x, w, out, bias_arg, height, width, oh, ow, m, oc_g, c_g, k,
            *x.stride(), *w.stride(), *out.stride(),
            *stride, *padding, *dilation,
            KH=kh, KW=kw,
            HAS_BIAS=bias is not None,
            DOT=float_dot(x.dtype),
            **config.meta(),
        )  # fmt: skip

    key = shape_key(
        x="x".join(map(str, x.shape)), w="x".join(map(str, w.shape)), s=stride, p=padding, d=dilation,
        g=groups, dtype=str(x.dtype).removeprefix("torch."), bias=bias is not None,
    )  # fmt: skip
    launch_tuned(_TUNER, key, x, launch)
    return out


def conv2d(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
    groups: int = 1,
) -> torch.Tensor:
    """NCHW conv2d by implicit GEMM (same result as torch.nn.functional.conv2d, zero padding).

    x: [N, C, H, W] float16 / bfloat16 / float32; w: [OC, C / groups, KH, KW] in x's dtype;
    bias: [OC] or None. Returns [N, OC, OH, OW] with OH = (H + 2*ph - dh*(KH-1) - 1) // sh + 1.
    """
    stride, padding, dilation = (
        _pair(stride, "stride"),
        _pair(padding, "padding"),
        _pair(dilation, "dilation"),
    )
    if x.dim() != 4 or w.dim() != 4:
        raise TesselError(
            f"conv2d wants x [N, C, H, W] and w [OC, C, KH, KW]; got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    if x.dtype not in FLOAT_DTYPES or w.dtype != x.dtype:
        raise TesselError(f"conv2d wants x and w of one float dtype; got {x.dtype} and {w.dtype}")
    if groups < 1 or x.shape[1] % groups or w.shape[0] % groups or w.shape[1] * groups != x.shape[1]:
        raise TesselError(
            f"conv2d: x has {x.shape[1]} channels, w is {tuple(w.shape)}, groups={groups}: "
            "need C = w.shape[1] * groups and OC divisible by groups"
        )
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0:
        raise TesselError(
            f"conv2d wants stride, dilation >= 1 and padding >= 0; got {stride}, {dilation}, {padding}"
        )
    if bias is not None and bias.shape != (w.shape[0],):
        raise TesselError(f"conv2d wants bias [{w.shape[0]}]; got {tuple(bias.shape)}")
    out_hw = tuple(
        (size + 2 * pad - dil * (kernel - 1) - 1) // st + 1
        for size, pad, dil, kernel, st in zip(
            x.shape[2:], padding, dilation, w.shape[2:], stride, strict=True
        )
    )
    if min(out_hw) < 1:
        raise TesselError(
            f"conv2d: input {tuple(x.shape[2:])} is smaller than the dilated kernel (output {out_hw})"
        )
    if x.numel() and use_triton(x, w):
        return _conv2d_triton(x, w, bias, stride, padding, dilation, groups, out_hw)  # type: ignore[arg-type]
    return torch.nn.functional.conv2d(x, w, bias, stride, padding, dilation, groups)
