"""Triton kernels with PyTorch paths; see `tessel.kernels.dispatch` for how a call picks one.

One op per module (`tessel.kernels.rms_norm` holds `_rms_norm_forward_kernel`, its launcher and
the public `rms_norm`); the scaffolding they share is in `tessel.kernels._utils`. The public
functions are exported here, so `from tessel.kernels import rms_norm` gives the function. Importing
them binds each name to the function after its module has loaded, so the package attribute
`tessel.kernels.rms_norm` is the function; the module itself is reached with
`from tessel.kernels.rms_norm import ...` or `importlib.import_module("tessel.kernels.rms_norm")`.

The engine's path (what a served model runs, through `tessel.layers`):

    rms_norm, rope, silu_and_mul, flash_attention (prefill), paged_decode_attention (decode),
    quantize_per_token + int8_gemm (W8A8), w8a16_gemm (W8A16 on CUDA), and the CPU side:
    int8_cpu (fbgemm's GEMMs), w8a16_cpu (compiled int8 GEMVs), cpu_compile, cpu_features
    (which CPU path a W8A8 / W8A16 layer takes)

A library beside it (tested in tests/kernels, run by no engine step): conv2d (`tessel.layers.Conv2d`),
transpose, softmax / log_softmax, layer_norm, flash_attention_int8, and `linear`, the float GEMM
behind `tessel.layers.Linear`'s trainable path (the engine's float layers run PyTorch's or oneDNN's).
"""

from tessel.kernels.conv2d import conv2d
from tessel.kernels.flash_attention import flash_attention, flash_attention_int8
from tessel.kernels.int8_gemm import int8_gemm
from tessel.kernels.layer_norm import layer_norm
from tessel.kernels.paged_decode import paged_decode_attention
from tessel.kernels.quantize_rows import quantize_per_token
from tessel.kernels.rms_norm import rms_norm
from tessel.kernels.rope import rope
from tessel.kernels.silu_and_mul import silu_and_mul
from tessel.kernels.softmax import log_softmax, softmax
from tessel.kernels.transpose import transpose
from tessel.kernels.w8a16_gemm import linear, w8a16_gemm

__all__ = [
    "conv2d",
    "flash_attention",
    "flash_attention_int8",
    "int8_gemm",
    "layer_norm",
    "linear",
    "log_softmax",
    "paged_decode_attention",
    "quantize_per_token",
    "rms_norm",
    "rope",
    "silu_and_mul",
    "softmax",
    "transpose",
    "w8a16_gemm",
]
