"""Per-token (per-row) symmetric dynamic int8 quantisation, fused into one pass over the row.

    scale[m] = max(max_k |x[m, k]|, EPS) / 127
    q[m, k]  = round_half_even(x[m, k] / scale[m])          in [-127, 127]

so that x ~= q * scale[:, None]. The same function quantises a weight per output channel
(a weight row is a "token" of the GEMM's other operand).
"""

from __future__ import annotations

import torch

from tessel.errors import TesselError
from tessel.kernels import _utils
from tessel.kernels._utils import tl, triton
from tessel.kernels.dispatch import use_triton

QMAX = 127
# A row of zeros gets scale EPS/127 instead of 0, so q = 0 and x / scale stays finite.
EPS = 1e-8
# Rows up to this many elements are quantised from registers after one load (one read of x);
# longer rows take a second pass over the row in chunks of this size.
MAX_SINGLE_PASS_K = 8192
IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


if triton is not None:

    @triton.jit
    def _round_half_even(y):
        # Exact for |y| < 2**22 with only exact float ops (no libdevice.rint, which the Triton
        # interpreter lacks): floor, then y - floor(y) is exact, then break ties to even.
        r = tl.floor(y)
        frac = y - r
        ri = r.to(tl.int32)
        up = (frac > 0.5) | ((frac == 0.5) & ((ri & 1) == 1))
        return ri + up.to(tl.int32)

    @triton.jit
    def _quantize_per_token_kernel(
        X_ptr,
        Q_ptr,
        Scale_ptr,
        K,
        x_row_stride,
        x_col_stride,
        q_row_stride,
        SINGLE_PASS: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = X_ptr + row * x_row_stride
        q_row = Q_ptr + row * q_row_stride
        cols = tl.arange(0, BLOCK_K)
        if SINGLE_PASS:
            mask = cols < K
            x = tl.load(x_row + cols * x_col_stride, mask=mask, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=0)
        else:
            running = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for start in range(0, K, BLOCK_K):
                mask = start + cols < K
                chunk = tl.load(x_row + (start + cols) * x_col_stride, mask=mask, other=0.0)
                running = tl.maximum(running, tl.abs(chunk.to(tl.float32)))
            amax = tl.max(running, axis=0)
        scale = tl.math.div_rn(tl.maximum(amax, 1e-8), 127.0)
        tl.store(Scale_ptr + row, scale)
        # div_rn (IEEE round-to-nearest, like torch's division; plain `/` may lower to an approximate
        # division on CUDA) does not broadcast a scalar operand, so the scale is widened to a block.
        scales = tl.zeros((BLOCK_K,), dtype=tl.float32) + scale
        if SINGLE_PASS:
            q = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x, scales)), -127), 127)
            tl.store(q_row + cols, q.to(tl.int8), mask=mask)
        else:
            for start in range(0, K, BLOCK_K):
                mask = start + cols < K
                chunk = tl.load(x_row + (start + cols) * x_col_stride, mask=mask, other=0.0)
                q = tl.minimum(
                    tl.maximum(_round_half_even(tl.math.div_rn(chunk.to(tl.float32), scales)), -127), 127
                )
                tl.store(q_row + start + cols, q.to(tl.int8), mask=mask)


def _quantize_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    q = _utils.empty_output((M, K), torch.int8, x.device)
    scale = _utils.empty_output((M,), torch.float32, x.device)
    single_pass = K <= MAX_SINGLE_PASS_K
    block_k = triton.next_power_of_2(K) if single_pass else MAX_SINGLE_PASS_K
    num_warps = 4 if block_k <= 2048 else 8 if block_k <= 4096 else 16
    _quantize_per_token_kernel[(M,)](
        x, q, scale, K, x.stride(0), x.stride(1), q.stride(0),
        SINGLE_PASS=single_pass, BLOCK_K=block_k, num_warps=num_warps,
    )  # fmt: skip
    return q, scale


def _quantize_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = per_token_codes(x)
    return codes.to(torch.int8), scale


def per_token_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_token` in PyTorch, its codes left in float32 (integers in [-127, 127]): the one
    formula of the per-token quantiser, eager on CPU and traced into the compiled CPU kernels and
    decode steps."""
    return row_codes(x, QMAX)


def row_codes(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric codes of each row of x [M, K] in [-qmax, qmax], as float32 integers, and the row
    scales max(max_k |x[m, k]|, EPS) / qmax [M] (qmax 63: 7-bit weight codes)."""
    # Four passes over [M, K] (abs, amax, divide, round in place); everything else is [M].
    # abs + amax, not aminmax: torch 2.13's aminmax over dim 1 is not vectorised on every CPU
    # (`benchmarks/decode_profile.py --torch-profiler` showed it). No clamp is needed: |x| <= amax
    # and scale = fl(amax / qmax), so |x / scale| <= qmax * (1 + 2**-22) < qmax + 0.5 and rounds
    # into range (a row under EPS has scale > amax / qmax).
    scale = x.abs().amax(dim=1).float().clamp_min_(EPS).div_(qmax)
    y = torch.div(x, scale.view(-1, 1)) if x.dtype == torch.float32 else x.float().div_(scale.view(-1, 1))
    return y.round_(), scale


def static_codes(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of x [M, K] by one calibrated scale (static activations), left in float32:
    clamp(round(x / s), -127, 127), and s repeated per row (the scales `int8_epilogue` takes)."""
    codes = torch.round(x.float() / input_scale).clamp_(-QMAX, QMAX)
    return codes, input_scale.expand(x.shape[0])


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantisation: scale = max|x[m]| / 127, q = round(x / scale).

    x: float16 / bfloat16 / float32 [M, K]. Returns (q int8 [M, K], scale float32 [M]) with
    x ~= q * scale[:, None]; a zero row gets q = 0 and a tiny positive scale.
    """
    if x.dim() != 2:
        raise TesselError(f"quantize_per_token wants x [M, K]; got shape {tuple(x.shape)}")
    if x.dtype not in IN_DTYPES:
        raise TesselError(f"quantize_per_token wants a float16/bfloat16/float32 x; got {x.dtype}")
    if x.numel() == 0:
        scale = torch.full((x.shape[0],), EPS / QMAX, dtype=torch.float32, device=x.device)
        return torch.zeros(x.shape, dtype=torch.int8, device=x.device), scale
    if use_triton(x):
        return _quantize_triton(x)
    return _quantize_torch(x)
