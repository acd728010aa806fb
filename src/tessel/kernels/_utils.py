"""Scaffolding shared by the Triton ops (as Liger-Kernel keeps `ops/utils.py`).

- `triton`, `tl`: the guarded import; None where Triton is not installed (the PyTorch paths
  still work, and an op module still imports);
- `interpreting()`: whether kernels run under the Triton interpreter (`TRITON_INTERPRET=1`);
- `LOG2_E`, `FLOAT_DTYPES`: the constants several ops share;
- `empty_output(...)`: every output buffer a host function hands to a kernel. Kernels write every
  element of their output, so the buffer starts uninitialised. Tests replace it with a buffer
  full of values no kernel produces (NaN, an out-of-range int), so an element a kernel forgets to
  write fails the comparison; host functions therefore call it as `_utils.empty_output(...)`,
  looked up at call time;
- `row_meta`, `num_warps`: block size and warps of a one-row-per-program kernel;
- `last_dim_contiguous`, `as_rows`: the layouts the row kernels take;
- `float_dot`, `dot_acc`: how a tile product is multiplied (the `DOT` constexpr of the GEMM and
  conv kernels); `grouped_tile`, `dot_operand`: the other `@triton.jit` helpers of tiled kernels.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch paths still work
    triton = None
    tl = None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def empty_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


LOG2_E = 1.4426950408889634  # the attention kernels use exp2: exp(x) = exp2(x * log2(e))
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the float inputs the GEMM-like kernels take


# One row per program: a row up to this many bytes is held in registers at once; a wider one is
# walked in chunks of this size.
MAX_FUSED_ROW_BYTES = 65536


def num_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel of `block` lanes (Liger-Kernel's calculate_settings)."""
    return 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


def row_meta(n_cols: int, element_size: int, max_bytes: int = MAX_FUSED_ROW_BYTES) -> dict[str, int | bool]:
    """Launch meta-parameters of a one-row-per-program kernel: BLOCK_SIZE lanes (the row rounded up
    to a power of two, at most `max_bytes` of `element_size` elements, at least 16), SINGLE_BLOCK
    when the row fits in them (else the kernel walks it in chunks), and the warps for that block."""
    block = min(triton.next_power_of_2(max(n_cols, 1)), max(max_bytes // element_size, 16))
    return {"BLOCK_SIZE": block, "SINGLE_BLOCK": block >= n_cols, "num_warps": num_warps(block)}


def float_dot(dtype: torch.dtype) -> str:
    """The `dot_acc` mode for float operands: exact fp32 products for fp32; bf16 under the
    interpreter as fp32 too (Triton 3.9's interpreter multiplies bf16 tiles as raw uint16 bit
    patterns); otherwise the native dot of the dtype."""
    return "fp32" if dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting()) else "native"


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """A [rows, last dim] view (a copy only when the last dim is strided) of a tensor of any rank."""
    return last_dim_contiguous(t.reshape(-1, t.shape[-1]) if t.dim() > 0 else t.reshape(1, 1))


def empty_rows_like(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An uninitialised output of `x`'s shape, dtype and device, and its [rows, last dim] view."""
    out = empty_output(x.shape, x.dtype, x.device)
    return out, out.view(-1, x.shape[-1])


def row_operands(*rows: torch.Tensor) -> list[torch.Tensor | int]:
    """Each [rows, cols] tensor followed by its row stride: the pointer arguments of a row kernel."""
    return [arg for t in rows for arg in (t, t.stride(0))]


if triton is not None:

    @triton.jit
    def program_row(ptr, row_stride):
        """The start of this program's row in a one-row-per-program kernel (64-bit: rows x stride
        may pass 2**31 elements)."""
        return ptr + tl.program_id(0).to(tl.int64) * row_stride

    @triton.jit
    def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Row and column offsets of the [BLOCK_M, BLOCK_N] output tile of program `pid`, in grouped
        order: GROUP_M row tiles walk the column tiles together, so the column operand's tiles they
        share are read while in L2 (the order of Triton's matmul tutorial)."""
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = tl.swizzle2d(
            pid // num_pid_n, pid % num_pid_n, tl.cdiv(M, BLOCK_M), num_pid_n, GROUP_M
        )
        return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)

    @triton.jit
    def dot_acc(a, b, acc, DOT: tl.constexpr):
        """acc + a @ b, multiplied as DOT says: "int8" (int8 x int8, int32 accumulator), "int8_as_fp16"
        (the int8 codes as fp16, exact, for GPUs without an int8 MMA: sm_70/75), "fp32" (both
        operands as fp32, IEEE products) or "native" (b converted to a's dtype: int8 -> fp16/bf16
        is exact for |b| <= 127; the target's default precision)."""
        if DOT == "int8":
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        elif DOT == "int8_as_fp16":
            acc = tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
        elif DOT == "fp32":
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.to(a.dtype), acc)
        return acc

    @triton.jit
    def dot_operand(x, UPCAST: tl.constexpr):
        """The interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584): there,
        bf16 operands go in as their exact fp32 values, which is what a bf16 MMA multiplies."""
        if UPCAST:
            x = x.to(tl.float32)
        return x

else:  # the names still import where Triton is missing; nothing calls them there
    grouped_tile = dot_acc = dot_operand = program_row = None
