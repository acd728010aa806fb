"""Roofline time of a unit (decoder layer, attention block or MLP block) on one device.

    time = max(FLOPs / (eff_c * peak_flops), bytes / (eff_m * mem_bw)) + kernels * launch overhead

Weight GEMM FLOPs run at the peak of the weight dtype; the attention core (QK^T, PV) at the peak
of the activation dtype (fp16 under int8 W8A8). A measured `Profile` for the same device type,
model shape and dtype replaces the analytic time of the whole layer (its fit is per decoder
layer; an attention or MLP block gets the analytic share of it). A profile of the same device
type but another model shape contributes only its measured efficiencies (the commands refuse such
a profile unless forced: `tessel.cost.profile_check`).

The profile's other components (`Profile.components`) price, when timed on the same device type
and dtype at the model's sizes: the embedding (`embed_time_s`), the final norm + LM head +
sampling (`lm_head_time_s`), the engine's per-step work outside the model (`step_overhead_s`;
0 without a profile: the roofline has no term for it) and a message between two stages of one
host (`transport_time_s`; without one, the link's latency + bytes / bandwidth prices it).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.catalog.gpus import GpuSpec
from tessel.catalog.models import ModelSpec
from tessel.cost import layer as L
from tessel.cost.profile import PREFILL_BATCH, ComponentFit, Profile, transport_key

# Fraction of peak FLOP/s a whole layer reaches when compute-bound. cuBLAS fp16 GEMMs of LLM
# shapes reach 70-80% of tensor-core peak on A100; norms, RoPE, softmax and smaller attention
# GEMMs pull a layer lower. Megatron-LM sustains 52% of A100 peak end to end in training
# (Narayanan et al., SC'21: 163 of 312 TFLOP/s), which includes backward and communication;
# inference prefill sits above that. We use 0.6.
DEFAULT_COMPUTE_EFFICIENCY = 0.6
# Fraction of peak memory bandwidth reached when memory-bound. Streaming kernels reach 80-90% of
# HBM peak on A100/H100 (e.g. ~1.7 of 2.0 TB/s in STREAM-like copies); decode GEMVs come close.
DEFAULT_MEMORY_EFFICIENCY = 0.8
# Host-side cost of one kernel launch: 3-5 us for a CUDA launch from eager PyTorch (NVIDIA
# CUDA C++ Best Practices Guide, "kernel launch overhead"; PyTorch dispatch on top).
KERNEL_LAUNCH_OVERHEAD_S = 5e-6
# Kernels per block, unfused: attention = norm, qkv GEMM, RoPE, attention, o GEMM, residual add;
# MLP = norm, gate/up GEMM, act-and-mul, down GEMM, residual add.
KERNELS_PER_UNIT = {"attention": 6, "mlp": 5, "layer": 11}
KERNELS_EMBED = 1  # gather
KERNELS_LM_HEAD = 2  # final norm, LM head GEMM


@dataclass(frozen=True, slots=True)
class Efficiency:
    compute: float = DEFAULT_COMPUTE_EFFICIENCY
    memory: float = DEFAULT_MEMORY_EFFICIENCY


def roofline_time_s(
    *,
    weight_flops: float,
    attention_flops: float,
    n_bytes: float,
    gpu: GpuSpec,
    dtype: str,
    efficiency: Efficiency,
    kernels: int,
) -> float:
    """max(compute time, memory time) + launch overhead."""
    act = L.activation_dtype(dtype)
    compute_s = weight_flops / (efficiency.compute * gpu.peak_flops(L.compute_dtype(dtype)))
    compute_s += attention_flops / (efficiency.compute * gpu.peak_flops(act))
    memory_s = n_bytes / (efficiency.memory * gpu.mem_bandwidth_bytes_per_s)
    return max(compute_s, memory_s) + kernels * KERNEL_LAUNCH_OVERHEAD_S


def _same_device(profile: Profile, gpu: GpuSpec) -> bool:
    """A profile of the host serves an emulated copy of it too (its times are divided by the speed)."""
    return profile.device_type.strip().lower() == gpu.base_name.lower()


def exact_profile(profile: Profile | None, model: ModelSpec, gpu: GpuSpec, dtype: str) -> Profile | None:
    """The profile if it was measured on this device type, model shape and dtype."""
    if profile is None or not _same_device(profile, gpu) or profile.dtype != dtype:
        return None
    return profile if profile.matches(profile.device_type, L.profile_shape(model)) else None


def efficiency_for(profile: Profile | None, gpu: GpuSpec) -> Efficiency:
    """Measured efficiencies of a profile of this device type where set, else the defaults."""
    if profile is None or not _same_device(profile, gpu):
        return Efficiency()
    compute = profile.compute_efficiency or DEFAULT_COMPUTE_EFFICIENCY
    memory = profile.memory_efficiency or DEFAULT_MEMORY_EFFICIENCY
    return Efficiency(compute=compute, memory=memory)


def select_profile(
    profiles: tuple[Profile, ...] | list[Profile], model: ModelSpec, gpu: GpuSpec, dtype: str
) -> Profile | None:
    """From many profiles, the one for this GPU: an exact match first, else one with efficiencies."""
    for profile in profiles:
        if exact_profile(profile, model, gpu, dtype) is not None:
            return profile
    for profile in profiles:
        if _same_device(profile, gpu) and (profile.compute_efficiency or profile.memory_efficiency):
            return profile
    return None


# ---- analytic unit times --------------------------------------------------------------------


def unit_work(
    model: ModelSpec,
    kind: str,
    tokens: float,
    attention_pairs: float,
    kv_tokens: float,
    dtype: str,
    kv_dtype: str,
) -> tuple[float, float, float]:
    """(weight GEMM FLOPs, attention-core FLOPs, bytes moved) of `tokens` passing one unit whose
    attention covers `attention_pairs` (query, key) pairs and reads or writes `kv_tokens` KV entries."""
    n_bytes = L.weight_bytes_read(model, kind, dtype, tokens)
    n_bytes += tokens * L.activation_elems_per_token(model, kind) * L.dtype_bytes(L.activation_dtype(dtype))
    if kind != "mlp":
        n_bytes += L.kv_bytes_per_token(model, kv_dtype) * kv_tokens
    weight_flops = L.matmul_flops(model, kind, tokens)
    return weight_flops, L.attention_core_flops(model, kind, attention_pairs), n_bytes


def _analytic_unit_s(
    work: tuple[float, float, float], gpu: GpuSpec, kind: str, dtype: str, efficiency: Efficiency
) -> float:
    """Roofline time of one unit's `work` (`unit_work`: weight FLOPs, attention FLOPs, bytes)."""
    weight_flops, attention_flops, n_bytes = work
    return roofline_time_s(
        weight_flops=weight_flops,
        attention_flops=attention_flops,
        n_bytes=n_bytes,
        gpu=gpu,
        dtype=dtype,
        efficiency=efficiency,
        kernels=KERNELS_PER_UNIT[kind],
    )


def _analytic_prefill_s(
    model: ModelSpec,
    gpu: GpuSpec,
    kind: str,
    chunk_tokens: float,
    offset_tokens: float,
    batch_size: int,
    dtype: str,
    kv_dtype: str,
    efficiency: Efficiency,
) -> float:
    tokens = batch_size * chunk_tokens
    pairs = batch_size * L.query_key_pairs(model, chunk_tokens, offset_tokens)
    # read p cached tokens' KV, write c new ones
    kv_tokens = batch_size * (offset_tokens + chunk_tokens)
    work = unit_work(model, kind, tokens, pairs, kv_tokens, dtype, kv_dtype)
    return _analytic_unit_s(work, gpu, kind, dtype, efficiency)


def _analytic_decode_s(
    model: ModelSpec,
    gpu: GpuSpec,
    kind: str,
    batch_size: int,
    sum_context_tokens: float,
    dtype: str,
    kv_dtype: str,
    efficiency: Efficiency,
) -> float:
    # read every sequence's context (the new token's KV included)
    work = unit_work(model, kind, batch_size, sum_context_tokens, sum_context_tokens, dtype, kv_dtype)
    return _analytic_unit_s(work, gpu, kind, dtype, efficiency)


def _share(kind: str, attention_s: float, mlp_s: float) -> float:
    """The part of a whole-layer time that `kind` gets, by the analytic ratio."""
    return {
        "layer": 1.0,
        "attention": attention_s / (attention_s + mlp_s),
        "mlp": mlp_s / (attention_s + mlp_s),
    }[kind]


def unit_prefill_time_s(
    model: ModelSpec,
    gpu: GpuSpec,
    kind: str,
    chunk_tokens: float,
    offset_tokens: float,
    *,
    batch_size: int = 1,
    dtype: str = "fp16",
    kv_dtype: str = "fp16",
    profile: Profile | None = None,
) -> float:
    """Seconds for one unit to prefill `batch_size` sequences' chunks of c tokens at offset p."""
    L._check_kind(kind)
    if chunk_tokens <= 0 or batch_size <= 0:
        return 0.0
    args = (chunk_tokens, offset_tokens, batch_size, dtype, kv_dtype)
    efficiency = efficiency_for(profile, gpu)
    exact = exact_profile(profile, model, gpu, dtype)
    if exact is None:
        return _analytic_prefill_s(model, gpu, kind, *args, efficiency)
    # The fit is one sequence through one layer; more sequences in the pass repeat all of it but
    # what a pass pays once (`prefill_shared_s`).
    one_s = max(exact.prefill.time_s(chunk_tokens, offset_tokens), 0.0) / gpu.emulate_speed
    shared_s = min(prefill_shared_s(exact, gpu), one_s)
    layer_s = batch_size * one_s - (batch_size - 1) * shared_s
    attention_s = _analytic_prefill_s(model, gpu, "attention", *args, efficiency)
    mlp_s = _analytic_prefill_s(model, gpu, "mlp", *args, efficiency)
    return max(layer_s, 0.0) * _share(kind, attention_s, mlp_s)


def prefill_shared_s(exact: Profile, gpu: GpuSpec) -> float:
    """Seconds of one layer's prefill that a pass pays once however many sequences it holds (each
    more sequence costs its own chunk's time less this): the intercept of the profile's
    `prefill_batch` fit (passes of n sequences' chunks, `tessel.profiling.layer`), or, for a profile
    without one, the prefill fit's intercept a0."""
    batch = exact.components.get(PREFILL_BATCH)
    shared_s = batch.c0 if batch is not None else exact.prefill.a0
    return max(shared_s, 0.0) / gpu.emulate_speed


def unit_decode_time_s(
    model: ModelSpec,
    gpu: GpuSpec,
    kind: str,
    batch_size: int,
    sum_context_tokens: float,
    *,
    dtype: str = "fp16",
    kv_dtype: str = "fp16",
    profile: Profile | None = None,
) -> float:
    """Seconds for one unit to run one decode step of `batch_size` sequences whose contexts
    (the new token included) add up to `sum_context_tokens`."""
    L._check_kind(kind)
    if batch_size <= 0:
        return 0.0
    args = (batch_size, sum_context_tokens, dtype, kv_dtype)
    efficiency = efficiency_for(profile, gpu)
    exact = exact_profile(profile, model, gpu, dtype)
    if exact is None:
        return _analytic_decode_s(model, gpu, kind, *args, efficiency)
    layer_s = exact.decode.time_s(batch_size, sum_context_tokens) / gpu.emulate_speed
    attention_s = _analytic_decode_s(model, gpu, "attention", *args, efficiency)
    mlp_s = _analytic_decode_s(model, gpu, "mlp", *args, efficiency)
    return max(layer_s, 0.0) * _share(kind, attention_s, mlp_s)


def embed_time_s(
    model: ModelSpec, gpu: GpuSpec, tokens: int, dtype: str = "fp16", *, profile: Profile | None = None
) -> float:
    """Embedding lookup of `tokens` tokens on the first stage: a memory-bound gather."""
    if tokens <= 0:
        return 0.0
    measured = _component(profile, "embed", model, gpu, dtype)
    if measured is not None:
        return measured.time_s(tokens) / gpu.emulate_speed
    table_rows_bytes = L.embedding_bytes(model, dtype) // (model.vocab_size + model.learned_position_rows)
    rows = 2 if model.learned_position_rows else 1  # token row (+ position row)
    out_bytes = L.hidden_bytes(model, tokens, L.activation_dtype(dtype))
    n_bytes = tokens * rows * table_rows_bytes + out_bytes
    return _no_attention_time_s(0.0, n_bytes, gpu, dtype, profile, KERNELS_EMBED)


def lm_head_time_s(
    model: ModelSpec, gpu: GpuSpec, tokens: int, dtype: str = "fp16", *, profile: Profile | None = None
) -> float:
    """Final norm + LM head on the last stage for `tokens` tokens (in prefill, only the last
    token of each sequence needs logits). The LM head stays fp16 under int8."""
    if tokens <= 0:
        return 0.0
    measured = _component(profile, "head", model, gpu, dtype)
    if measured is not None:
        return measured.time_s(tokens) / gpu.emulate_speed
    flops, n_bytes = lm_head_work(model, tokens, dtype)
    return _no_attention_time_s(flops, n_bytes, gpu, L.activation_dtype(dtype), profile, KERNELS_LM_HEAD)


def step_overhead_s(gpu: GpuSpec, sequences: int, dtype: str, *, profile: Profile | None = None) -> float:
    """The engine's work outside the model in one step of `sequences` sequences (scheduling, the
    step's inputs, appending tokens): the profile's "step" fit, 0 without one. Host work: not
    scaled by an emulated device's speed (the runtime's emulation stretches compute only)."""
    measured = _component(profile, "step", None, gpu, dtype)
    return 0.0 if measured is None or sequences <= 0 else measured.time_s(sequences)


def transport_time_s(
    profile: Profile | None, transport: str, gpu: GpuSpec, dtype: str, n_bytes: float
) -> float | None:
    """One stage-to-stage message carrying `n_bytes` of hidden states over `transport` ("host",
    "nccl"), from the profile of the sending device type; None when it has no such fit."""
    measured = _component(profile, transport_key(transport), None, gpu, dtype)
    return None if measured is None else measured.time_s(n_bytes)


def cores_profile(
    profiles: tuple[Profile, ...] | list[Profile], gpu: GpuSpec, preferred: Profile | None
) -> Profile | None:
    """The profile whose host cores and threads price core sharing on `gpu`: `preferred` (the one
    chosen for the reference precision) when it knows the cores, else any profile of the device type
    that does (a host's cores do not depend on the precision a profile timed)."""
    if preferred is not None and preferred.cpu_cores:
        return preferred
    return next((p for p in profiles if _same_device(p, gpu) and p.cpu_cores), preferred)


def core_share_factor(sharing_stages: int, profile: Profile | None) -> float:
    """How much slower each of `sharing_stages` CPU stages on one host computes when they all run at
    once on its cores: max(1, stages x threads per stage / cores), with the cores and threads of the
    host's profile (1 without a profile that knows them)."""
    if profile is None or not profile.cpu_cores:
        return 1.0
    return max(1.0, sharing_stages * (profile.threads or 1) / profile.cpu_cores)


def _component(
    profile: Profile | None, name: str, model: ModelSpec | None, gpu: GpuSpec, dtype: str
) -> ComponentFit | None:
    """The profile's `name` fit when it was timed on this device type and dtype (and, with a
    model, at its hidden and vocabulary sizes)."""
    if profile is None or not _same_device(profile, gpu) or profile.dtype != dtype:
        return None
    shape = {} if model is None else {"hidden_size": model.hidden_size, "vocab_size": model.vocab_size}
    return profile.component(name, shape)


def lm_head_work(model: ModelSpec, tokens: float, dtype: str = "fp16") -> tuple[float, float]:
    """(FLOPs, bytes moved) of the final norm + LM head for `tokens` tokens (fp16 under int8); an
    encoder has neither (its pooling is not counted: `tessel.cost.layer`)."""
    if model.encoder:
        return 0.0, 0.0
    b_act = L.dtype_bytes(L.activation_dtype(dtype))
    n_bytes = L.lm_head_bytes(model, dtype) + tokens * (3 * model.hidden_size + model.vocab_size) * b_act
    return 2.0 * tokens * model.hidden_size * model.vocab_size, n_bytes


def _no_attention_time_s(
    weight_flops: float, n_bytes: float, gpu: GpuSpec, dtype: str, profile: Profile | None, kernels: int
) -> float:
    """Roofline time of an op with no attention core (embedding, LM head), at the profile's efficiency."""
    return roofline_time_s(
        weight_flops=weight_flops,
        attention_flops=0.0,
        n_bytes=n_bytes,
        gpu=gpu,
        dtype=dtype,
        efficiency=efficiency_for(profile, gpu),
        kernels=kernels,
    )
