"""MFU and MBU of a pipeline stage: how much of its device's catalog peak a stage's work uses.

    MFU = achieved FLOP/s / peak FLOP/s      MBU = achieved bytes/s / peak memory bandwidth

The FLOPs and bytes are the cost model's own (`tessel.cost.roofline.unit_work`, `lm_head_work`).
Weight GEMMs count against the peak of their weight precision's compute dtype and the attention
core against the activation dtype's, so with one precision MFU is FLOPs / (seconds x peak); with
mixed precisions it is the seconds the FLOPs need at peak over the seconds taken.

Peaks are the catalog's (`tessel/catalog/gpus.yaml`: peak_tflops, mem_bandwidth_gbs), scaled by an
emulated device's speed. The catalog's `cpu` is a generic 16-core AVX-512 host, not this machine.

`stage_token_work` is for measured runs, which record tokens and batches but not contexts: it
counts the weight GEMMs and weight + activation bytes only (no attention core, KV reads or LM head),
so the MFU and MBU it gives are lower bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tessel.catalog.gpus import GpuSpec
from tessel.catalog.models import ModelSpec
from tessel.cost import layer as L
from tessel.cost.roofline import lm_head_work, unit_work
from tessel.errors import TesselError


@dataclass(frozen=True, slots=True)
class Work:
    flops: float
    n_bytes: float
    peak_s: float  # seconds the FLOPs take at the device's peak

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.n_bytes + other.n_bytes, self.peak_s + other.peak_s)


@dataclass(frozen=True, slots=True)
class Utilization:
    mfu: float
    mbu: float

    def to_json(self) -> dict[str, float]:
        return {"mfu": self.mfu, "mbu": self.mbu}


NO_WORK = Work(0.0, 0.0, 0.0)


def work_at_peak(
    gpu: GpuSpec, dtype: str, weight_flops: float, attention_flops: float, n_bytes: float
) -> Work:
    """Work of these FLOPs and bytes: weight GEMMs at `dtype`'s compute peak, the attention core at
    its activation dtype's."""
    peak_s = weight_flops / gpu.peak_flops(L.compute_dtype(dtype))
    peak_s += attention_flops / gpu.peak_flops(L.activation_dtype(dtype))
    return Work(weight_flops + attention_flops, float(n_bytes), peak_s)


def _check(kinds: Sequence[str], dtypes: Sequence[str]) -> None:
    if len(kinds) != len(dtypes):
        raise TesselError(f"a stage of {len(kinds)} units was given {len(dtypes)} precisions")


def stage_decode_work(
    model: ModelSpec,
    gpu: GpuSpec,
    kinds: Sequence[str],
    dtypes: Sequence[str],
    batch_size: int,
    sum_context_tokens: float,
    *,
    kv_dtype: str = "fp16",
    last: bool = False,
) -> Work:
    """One decode step of `batch_size` sequences (contexts summing to `sum_context_tokens`) through
    units of `kinds` at `dtypes`, plus the LM head on the last stage."""
    _check(kinds, dtypes)
    work = NO_WORK
    for kind, dtype in zip(kinds, dtypes, strict=True):
        parts = unit_work(model, kind, batch_size, sum_context_tokens, sum_context_tokens, dtype, kv_dtype)
        work += work_at_peak(gpu, dtype, *parts)
    if last and kinds:
        flops, n_bytes = lm_head_work(model, batch_size, dtypes[-1])
        work += work_at_peak(gpu, L.activation_dtype(dtypes[-1]), flops, 0.0, n_bytes)
    return work


def stage_prefill_work(
    model: ModelSpec,
    gpu: GpuSpec,
    kinds: Sequence[str],
    dtypes: Sequence[str],
    chunk_tokens: float,
    offset_tokens: float = 0.0,
    *,
    batch_size: int = 1,
    kv_dtype: str = "fp16",
    last: bool = False,
) -> Work:
    """Prefill of `batch_size` chunks of c tokens at offset p (logits for one token per sequence)."""
    _check(kinds, dtypes)
    tokens = batch_size * chunk_tokens
    pairs = batch_size * L.query_key_pairs(model, chunk_tokens, offset_tokens)
    kv_tokens = batch_size * (offset_tokens + chunk_tokens)
    work = NO_WORK
    for kind, dtype in zip(kinds, dtypes, strict=True):
        work += work_at_peak(gpu, dtype, *unit_work(model, kind, tokens, pairs, kv_tokens, dtype, kv_dtype))
    if last and kinds:
        flops, n_bytes = lm_head_work(model, batch_size, dtypes[-1])
        work += work_at_peak(gpu, L.activation_dtype(dtypes[-1]), flops, 0.0, n_bytes)
    return work


def stage_token_work(
    model: ModelSpec, gpu: GpuSpec, n_layers: int, dtype: str, tokens: int, batches: int
) -> Work:
    """What a run's counters allow: `tokens` through `n_layers` decoder layers in `batches` passes,
    each pass reading the layers' weights once (no attention core, KV or LM head: a lower bound)."""
    if n_layers < 0 or tokens < 0 or batches < 0:
        raise TesselError(f"negative stage counters: {n_layers} layers, {tokens} tokens, {batches} batches")
    per_token = L.activation_elems_per_token(model, "layer") * L.dtype_bytes(L.activation_dtype(dtype))
    n_bytes = n_layers * (batches * L.weight_bytes_read(model, "layer", dtype, 1) + tokens * per_token)
    flops = n_layers * L.matmul_flops(model, "layer", tokens)
    return work_at_peak(gpu, dtype, flops, 0.0, n_bytes)


def utilization(work: Work, seconds: float, gpu: GpuSpec) -> Utilization:
    """MFU and MBU of `work` done in `seconds` on `gpu` (NaN when no time was spent)."""
    if seconds <= 0:
        return Utilization(float("nan"), float("nan"))
    return Utilization(work.peak_s / seconds, work.n_bytes / (seconds * gpu.mem_bandwidth_bytes_per_s))
