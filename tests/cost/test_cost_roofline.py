"""Roofline times: regimes against hand-computed FLOPs and bytes, monotonicity, profile override."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tessel.catalog import get_gpu, load_model
from tessel.cost import (
    DEFAULT_COMPUTE_EFFICIENCY,
    DEFAULT_MEMORY_EFFICIENCY,
    KERNEL_LAUNCH_OVERHEAD_S,
    DecodeFit,
    PrefillFit,
    Profile,
    embed_time_s,
    kv_bytes_per_token,
    lm_head_time_s,
    profile_shape,
    select_profile,
    unit_decode_time_s,
    unit_prefill_time_s,
    weight_bytes,
)
from tessel.cost.roofline import KERNELS_PER_UNIT
from tessel.errors import TesselError

LAYER_OVERHEAD_S = KERNELS_PER_UNIT["layer"] * KERNEL_LAUNCH_OVERHEAD_S


def _fast_memory(name: str):
    """A GPU whose memory is so fast that every pass is compute-bound."""
    return dataclasses.replace(get_gpu(name), mem_bandwidth_bytes_per_s=1e30)


def _fast_compute(name: str):
    """A GPU whose compute is so fast that every pass is memory-bound."""
    gpu = get_gpu(name)
    return dataclasses.replace(gpu, peak_flops_per_s={k: 1e40 for k in gpu.peak_flops_per_s})


def test_compute_bound_prefill_matches_flops_by_hand() -> None:
    model = load_model("llama-2-7b")  # MHA: a*d = h = 4096, g = 32
    gpu = _fast_memory("A100-80G")
    c, p, batch = random.randint(1, 4000), random.randint(0, 4000), random.randint(1, 4)
    h, f = 4096, 11008
    p_matmul = 4 * h * h + 3 * h * f
    flops = batch * (2 * c * p_matmul + 4 * h * c * (p + c / 2))
    expected = flops / (DEFAULT_COMPUTE_EFFICIENCY * 312e12) + LAYER_OVERHEAD_S
    got = unit_prefill_time_s(model, gpu, "layer", c, p, batch_size=batch)
    assert got == pytest.approx(expected, rel=1e-12)
    mlp_flops = batch * 2 * c * 3 * h * f  # the MLP carries no attention term
    mlp = unit_prefill_time_s(model, gpu, "mlp", c, p, batch_size=batch)
    assert mlp == pytest.approx(
        mlp_flops / (DEFAULT_COMPUTE_EFFICIENCY * 312e12) + 5 * KERNEL_LAUNCH_OVERHEAD_S
    )


def test_memory_bound_decode_matches_bytes_by_hand() -> None:
    model = load_model("llama-3-70b")
    gpu = _fast_compute("A100-80G")
    batch = random.randint(1, 64)
    contexts = [random.randint(1, 8000) for _ in range(batch)]
    h, a, g, d, f = 8192, 64, 8, 128, 28672
    activations = 2 * batch * ((7 * h + (a + 2 * g) * d + 3 * a * d) + (7 * h + 6 * f))
    n_bytes = weight_bytes(model, "layer", "fp16") + 2 * g * d * 2 * sum(contexts) + activations
    expected = n_bytes / (DEFAULT_MEMORY_EFFICIENCY * 2039e9) + LAYER_OVERHEAD_S
    assert unit_decode_time_s(model, gpu, "layer", batch, sum(contexts)) == pytest.approx(expected, rel=1e-12)


def test_regimes_on_a_real_gpu() -> None:
    """Decode of one sequence is memory-bound; a long prefill is compute-bound (A100, 70B layer)."""
    model, gpu = load_model("llama-3-70b"), get_gpu("A100-80G")
    weights_s = weight_bytes(model, "layer", "fp16") / (
        DEFAULT_MEMORY_EFFICIENCY * gpu.mem_bandwidth_bytes_per_s
    )
    decode = unit_decode_time_s(model, gpu, "layer", 1, 100)
    assert weights_s < decode < 1.01 * weights_s + LAYER_OVERHEAD_S
    c = 4096
    flops_s = 2 * c * weight_bytes(model, "layer", "fp16") / 2 / (DEFAULT_COMPUTE_EFFICIENCY * 312e12)
    prefill = unit_prefill_time_s(model, gpu, "layer", c, 0)
    assert flops_s < prefill < 1.2 * flops_s  # plus the attention term c^2/2
    # ridge: per-token time falls with batch while memory-bound, then flattens
    per_token = [unit_decode_time_s(model, gpu, "layer", b, b * 10) / b for b in (1, 8, 64, 512, 4096)]
    assert per_token == sorted(per_token, reverse=True)
    assert per_token[-1] / per_token[-2] > 0.9


@pytest.mark.parametrize("gpu_name", ["T4", "V100-32G", "A100-80G", "H100", "RTX-4090", "cpu"])
@pytest.mark.parametrize("kind", ["layer", "attention", "mlp"])
def test_monotone_in_every_argument(gpu_name: str, kind: str) -> None:
    model, gpu = (
        load_model(random.choice(["llama-3-8b", "qwen2.5-7b", "mixtral-8x7b", "opt-30b"])),
        get_gpu(gpu_name),
    )
    rng = random.Random()
    for _ in range(20):
        c, p, b = rng.randint(1, 3000), rng.randint(0, 3000), rng.randint(1, 16)
        base = unit_prefill_time_s(model, gpu, kind, c, p, batch_size=b)
        assert base > 0
        assert unit_prefill_time_s(model, gpu, kind, c + rng.randint(1, 500), p, batch_size=b) >= base
        assert unit_prefill_time_s(model, gpu, kind, c, p + rng.randint(1, 500), batch_size=b) >= base
        assert unit_prefill_time_s(model, gpu, kind, c, p, batch_size=b + 1) >= base
        s = rng.randint(b, 50_000)
        dec = unit_decode_time_s(model, gpu, kind, b, s)
        assert unit_decode_time_s(model, gpu, kind, b, s + rng.randint(1, 5000)) >= dec
        assert unit_decode_time_s(model, gpu, kind, b + 1, s) >= dec


def test_offset_only_costs_attention() -> None:
    model, gpu = load_model("llama-3-8b"), get_gpu("L4")
    assert unit_prefill_time_s(model, gpu, "mlp", 256, 0) == unit_prefill_time_s(model, gpu, "mlp", 256, 9000)
    assert unit_prefill_time_s(model, gpu, "attention", 256, 9000) > unit_prefill_time_s(
        model, gpu, "attention", 256, 0
    )
    assert unit_decode_time_s(model, gpu, "mlp", 4, 10) == unit_decode_time_s(model, gpu, "mlp", 4, 90_000)


def test_blocks_add_up_to_at_least_the_layer() -> None:
    """max(a1, b1) + max(a2, b2) >= max(a1 + a2, b1 + b2): equal when both blocks share a regime."""
    model, gpu = load_model("llama-3-70b"), get_gpu("H100")
    for c, p in ((1, 0), (64, 100), (2048, 0), (8000, 8000)):
        layer = unit_prefill_time_s(model, gpu, "layer", c, p)
        blocks = unit_prefill_time_s(model, gpu, "attention", c, p) + unit_prefill_time_s(
            model, gpu, "mlp", c, p
        )
        assert blocks >= layer * (1 - 1e-12)
    compute = _fast_memory("H100")
    layer = unit_prefill_time_s(model, compute, "layer", 500, 300)
    blocks = unit_prefill_time_s(model, compute, "attention", 500, 300) + unit_prefill_time_s(
        model, compute, "mlp", 500, 300
    )
    assert blocks == pytest.approx(layer, rel=1e-12)


def test_faster_gpu_is_faster_and_int8_beats_fp16_when_compute_bound() -> None:
    model = load_model("llama-2-13b")
    times = [
        unit_prefill_time_s(model, get_gpu(name), "layer", 2048, 0) for name in ("T4", "A100-80G", "H100")
    ]
    assert times == sorted(times, reverse=True)
    a100 = get_gpu("A100-80G")
    assert unit_prefill_time_s(model, a100, "layer", 4096, 0, dtype="int8") < unit_prefill_time_s(
        model, a100, "layer", 4096, 0, dtype="fp16"
    )
    # memory-bound decode: int8 weights are half the bytes
    ratio = unit_decode_time_s(model, a100, "mlp", 1, 1, dtype="int8") / unit_decode_time_s(
        model, a100, "mlp", 1, 1
    )
    assert 0.45 < ratio < 0.55


def test_moe_decode_reads_few_experts_and_big_batches_read_all() -> None:
    model, gpu = load_model("mixtral-8x7b"), _fast_compute("A100-80G")
    dense_mlp = weight_bytes(model, "mlp", "fp16") / (DEFAULT_MEMORY_EFFICIENCY * 2039e9)
    overhead = KERNELS_PER_UNIT["mlp"] * KERNEL_LAUNCH_OVERHEAD_S
    one = unit_decode_time_s(model, gpu, "mlp", 1, 1) - overhead
    assert one == pytest.approx(dense_mlp * 2 / 8, rel=0.01)  # 2 of 8 experts
    many = unit_decode_time_s(model, gpu, "mlp", 64, 64) - overhead  # + 2% activations
    assert many == pytest.approx(dense_mlp, rel=0.03)


def test_kv_bytes_enter_prefill_with_offset() -> None:
    model, gpu = load_model("llama-2-7b"), _fast_compute("A100-80G")
    c, p = random.randint(1, 100), random.randint(1, 10_000)
    extra = unit_prefill_time_s(model, gpu, "attention", c, p) - unit_prefill_time_s(
        model, gpu, "attention", c, 0
    )
    assert extra == pytest.approx(
        kv_bytes_per_token(model) * p / (DEFAULT_MEMORY_EFFICIENCY * 2039e9), rel=1e-9
    )


def test_embed_and_lm_head() -> None:
    model, gpu = load_model("llama-3-8b"), get_gpu("A100-80G")
    assert embed_time_s(model, gpu, 0, "fp16") == 0.0
    assert 0 < embed_time_s(model, gpu, 10, "fp16") < embed_time_s(model, gpu, 10_000, "fp16")
    head_bytes_s = 2 * 128256 * 4096 / (DEFAULT_MEMORY_EFFICIENCY * 2039e9)
    assert lm_head_time_s(model, gpu, 1, "fp16") == pytest.approx(
        head_bytes_s + 2 * KERNEL_LAUNCH_OVERHEAD_S, rel=0.01
    )
    assert lm_head_time_s(model, gpu, 4096, "fp16") > 4096 * 2 * 128256 * 4096 / 312e12


def test_bad_arguments_are_user_errors() -> None:
    model, gpu = load_model("llama-3-8b"), get_gpu("T4")
    with pytest.raises(TesselError, match="unit kind"):
        unit_prefill_time_s(model, gpu, "ffn", 10, 0)
    with pytest.raises(TesselError, match="dtype"):
        unit_decode_time_s(model, gpu, "layer", 1, 10, dtype="fp4")


def _profile(model, device: str, dtype: str = "fp16", **efficiencies) -> Profile:
    rng = random.Random()
    return Profile(
        device_type=device,
        model_shape=profile_shape(model),
        dtype=dtype,
        prefill=PrefillFit(
            a0=rng.uniform(1e-5, 1e-3), a1=rng.uniform(1e-7, 1e-5), a2=rng.uniform(0, 1e-8), a3=1e-10
        ),
        decode=DecodeFit(b0=rng.uniform(1e-4, 1e-3), b1=rng.uniform(1e-6, 1e-5), b2=rng.uniform(1e-9, 1e-8)),
        heldout_rel_error=0.03,
        **efficiencies,
    )


def test_matching_profile_replaces_the_analytic_layer_time() -> None:
    model, gpu = load_model("llama-3-8b"), get_gpu("cpu")
    profile = _profile(model, "CPU")  # device names compare case-insensitively
    c, p, b = random.randint(1, 512), random.randint(0, 512), random.randint(1, 4)
    fit = profile.prefill
    expected = fit.a0 + b * (fit.time_s(c, p) - fit.a0)
    assert unit_prefill_time_s(model, gpu, "layer", c, p, batch_size=b, profile=profile) == pytest.approx(
        expected
    )
    split = sum(
        unit_prefill_time_s(model, gpu, k, c, p, batch_size=b, profile=profile) for k in ("attention", "mlp")
    )
    assert split == pytest.approx(expected)
    s = random.randint(b, 5000)
    assert unit_decode_time_s(model, gpu, "layer", b, s, profile=profile) == pytest.approx(
        profile.decode.time_s(b, s)
    )
    attention = unit_decode_time_s(model, gpu, "attention", b, s, profile=profile)
    assert 0 < attention < profile.decode.time_s(b, s)


def test_profile_of_other_shape_or_device_or_dtype() -> None:
    model, other = load_model("llama-3-8b"), load_model("llama-2-13b")
    gpu = _fast_memory("A100-80G")  # compute-bound: time scales with 1 / compute efficiency
    analytic = unit_prefill_time_s(model, gpu, "mlp", 1024, 0) - 5 * KERNEL_LAUNCH_OVERHEAD_S
    half = _profile(other, "A100-80G", compute_efficiency=DEFAULT_COMPUTE_EFFICIENCY / 2)
    slowed = unit_prefill_time_s(model, gpu, "mlp", 1024, 0, profile=half) - 5 * KERNEL_LAUNCH_OVERHEAD_S
    assert slowed == pytest.approx(2 * analytic)
    no_effs = _profile(other, "A100-80G")
    assert unit_prefill_time_s(model, gpu, "mlp", 1024, 0, profile=no_effs) == pytest.approx(
        analytic + 5 * KERNEL_LAUNCH_OVERHEAD_S
    )
    elsewhere = _profile(model, "T4", compute_efficiency=0.01)  # another device: ignored
    assert unit_prefill_time_s(model, gpu, "mlp", 1024, 0, profile=elsewhere) == pytest.approx(
        analytic + 5 * KERNEL_LAUNCH_OVERHEAD_S
    )
    bf16 = _profile(model, "A100-80G", dtype="bf16")  # measured in another dtype: not a replacement
    assert unit_prefill_time_s(model, gpu, "mlp", 1024, 0, profile=bf16) == pytest.approx(
        analytic + 5 * KERNEL_LAUNCH_OVERHEAD_S
    )


def test_select_profile_prefers_the_exact_match() -> None:
    model, gpu = load_model("llama-3-8b"), get_gpu("A100-80G")
    exact = _profile(model, "A100-80G")
    effs = _profile(load_model("llama-2-7b"), "a100-80g", memory_efficiency=0.5)
    other = _profile(model, "T4")
    assert select_profile((effs, other, exact), model, gpu, "fp16") is exact
    assert select_profile((other, effs), model, gpu, "fp16") is effs
    assert select_profile((other,), model, gpu, "fp16") is None


@pytest.mark.parametrize("speed", [0.5, 0.25, 0.8])
def test_host_profile_prices_an_emulated_copy_at_its_speed(speed: float) -> None:
    """A cluster's `emulate: {speed}` device is the host at `speed`: the host's profile applies, its
    measured layer times divided by the speed (before, the renamed device matched no profile)."""
    model, host = load_model("llama-3-8b"), get_gpu("cpu")
    slow = host.emulated(speed)
    profile = _profile(model, "cpu")
    assert select_profile((profile,), model, slow, "fp16") is profile
    c, p, b, s = random.randint(1, 512), random.randint(0, 512), random.randint(1, 4), 3000
    fast = unit_prefill_time_s(model, host, "layer", c, p, batch_size=b, profile=profile)
    slowed = unit_prefill_time_s(model, slow, "layer", c, p, batch_size=b, profile=profile)
    assert slowed == pytest.approx(fast / speed)
    assert unit_decode_time_s(model, slow, "layer", b, s, profile=profile) == pytest.approx(
        unit_decode_time_s(model, host, "layer", b, s, profile=profile) / speed
    )
    # attention and MLP split the slowed layer time (shares from the analytic model)
    parts = [
        unit_prefill_time_s(model, slow, k, c, p, batch_size=b, profile=profile) for k in ("attention", "mlp")
    ]
    assert sum(parts) == pytest.approx(slowed)
    assert slow.emulated(0.5).emulate_speed == pytest.approx(speed * 0.5)  # speeds compose
