"""The linear layers: one per weight scheme, each choosing its path once.

    Linear       float weights                       dense.py   `gemm` (tessel's GEMM, trainable) or
                                                                `packed` (oneDNN, the engine's CPU float32)
    W8A8Linear   int8 weights, int8 activations      w8a8.py    `int8_gemm` on CUDA; on CPU int_mm,
                                                                fp16codes, fbgemm or dequant by the CPU
    W8A16Linear  int8 weights, float activations     w8a16.py   `w8a16_gemm` on CUDA; on CPU gemv,
                                                                fp16codes, bf16 or dequant by the CPU
    W4A16, asymmetric or grouped weight-only schemes run as a float `nn.Linear` holding the
    de-quantised weight (`dequantized_linear`), packed for oneDNN on the CPU like any float layer.

Each takes inputs [..., in_features] and returns [..., out_features] in the input's dtype. A
layer's path follows its weight's device and this CPU's features (`tessel.kernels.cpu_features`),
is chosen at construction (again on `set_path`, a move, a `load_state_dict`) and is its `path`.
The compiled CPU decode steps take a layer's one-row form (`layer.one_row_form()`) and its split
form (`layer.split()`), described in forms.py; `linear_form(m)` / `split_linear(m)` ask any module.
On CUDA the GEMMs tune their tiles per row bucket on first use; `tune_linears(model, max_rows,
dtype)` (tuning.py) does it for every bucket up front, as a warm-up should.
"""

from tessel.layers.linear.dense import (
    BATCH_HINT,
    TILE_ROWS,
    Linear,
    dequantized_linear,
    pack_linears,
    packed_bucket_rows,
    packed_linear,
    packing_available,
)
from tessel.layers.linear.forms import Kept, LinearForm, SplitLinear, linear_form, split_linear
from tessel.layers.linear.int8_weights import GEMV_MAX_ROWS, quantize_int8_weight
from tessel.layers.linear.tuning import tune_linears, tune_rows, tuned_kernel
from tessel.layers.linear.w8a8 import W8A8Linear
from tessel.layers.linear.w8a16 import W8A16Linear

__all__ = [
    "BATCH_HINT",
    "GEMV_MAX_ROWS",
    "TILE_ROWS",
    "Kept",
    "Linear",
    "LinearForm",
    "SplitLinear",
    "W8A8Linear",
    "W8A16Linear",
    "packed_bucket_rows",
    "dequantized_linear",
    "linear_form",
    "pack_linears",
    "packed_linear",
    "packing_available",
    "quantize_int8_weight",
    "split_linear",
    "tune_linears",
    "tune_rows",
    "tuned_kernel",
]
