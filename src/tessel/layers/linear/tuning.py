"""Tune the CUDA linears' tiles before serving, not in the first request that needs them.

tessel's CUDA GEMMs (`int8_gemm` behind `W8A8Linear`, `w8a16_gemm` behind `W8A16Linear`, `linear`
behind a `Linear` on its `gemm` path) take their tile from `tessel.kernels.autotune`, per shape key
whose row part is `bucket_m(rows)`: 16, 32, 64, ... The first call that meets a key benchmarks
every candidate tile. A step's rows are its tokens, and the row counts a server meets are not
the ones a warm-up meets: decode steps have 1 to max_num_seqs rows, prefill steps up to
max_num_batched_tokens, and prefix caching shortens prefills to row counts no cold run produced
(32 prompts of 128 tokens whose first 112 are cached: 512 rows, issue 29). So

    tune_linears(model, max_rows, dtype)

runs each distinct CUDA linear of `model` (by kernel, shape and bias) once at every row bucket
that a call of 1 to `max_rows` rows falls into (`tune_rows`), on random rows of `dtype` (the
activation dtype: the tuning keys hold it). Under the Triton interpreter or with
`TESSEL_AUTOTUNE=0` the same calls run without benchmarking. Layers on a CPU path are left alone.
"""

from __future__ import annotations

import torch
from torch import nn

from tessel.errors import TesselError
from tessel.kernels.autotune import bucket_m
from tessel.kernels.dispatch import use_triton
from tessel.layers.linear.dense import Linear
from tessel.layers.linear.w8a8 import W8A8Linear
from tessel.layers.linear.w8a16 import GPU_PATH, W8A16Linear


def tune_rows(max_rows: int) -> list[int]:
    """The row buckets of the GEMMs' tuning keys that calls of 1 to `max_rows` rows meet:
    16, 32, ..., bucket_m(max_rows)."""
    if max_rows < 1:
        raise TesselError(f"tune_rows wants max_rows >= 1; got {max_rows}")
    rows, top = [bucket_m(1)], bucket_m(max_rows)
    while rows[-1] < top:
        rows.append(bucket_m(rows[-1] + 1))
    return rows


def tuned_kernel(module: nn.Module) -> str | None:
    """The tuned GEMM `module` calls (`int8_gemm`, `w8a16_gemm`, `linear`), or None: a layer on a CPU
    path, on the meta device, or no tessel linear."""
    weight = getattr(module, "weight", None)
    if weight is None or weight.is_meta:
        return None
    if isinstance(module, W8A8Linear):
        return None if module.plan.on_cpu else "int8_gemm"
    if isinstance(module, W8A16Linear):
        return "w8a16_gemm" if module.path == GPU_PATH else None
    if isinstance(module, Linear):
        return "linear" if module.path == "gemm" and use_triton(weight) else None
    return None


def tune_linears(model: nn.Module, max_rows: int, dtype: torch.dtype) -> list[tuple[str, int, int, bool]]:
    """Run one layer of each distinct tuned GEMM in `model` at every row bucket of `tune_rows(max_rows)`,
    so the autotuner picks (and caches) their tiles now; -> the GEMMs tuned, in model order, as
    (kernel, out_features, in_features, has a bias)."""
    rows = tune_rows(max_rows)
    layers: dict[tuple[str, int, int, bool], nn.Module] = {}
    for module in model.modules():
        kernel = tuned_kernel(module)
        if kernel is not None:
            key = (kernel, module.out_features, module.in_features, module.bias is not None)
            layers.setdefault(key, module)
    with torch.inference_mode():
        for (_, _, in_features, _), layer in layers.items():
            x = torch.randn(rows[-1], in_features, dtype=dtype, device=layer.weight.device)
            for m in rows:
                layer(x[:m])
    return list(layers)
