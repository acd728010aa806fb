"""MFU and MBU of a stage against FLOPs and bytes computed by hand for Llama-3-8B on an A100-80G."""

from __future__ import annotations

import math

import pytest

from tessel.catalog import get_gpu, load_model
from tessel.cost.utilization import (
    stage_decode_work,
    stage_prefill_work,
    stage_token_work,
    utilization,
)
from tessel.errors import TesselError

# Llama-3-8B: h 4096, a 32, g 8, d 128, f 14336 (gated MLP, RMSNorm, no biases)
H, A, G, D, F, V = 4096, 32, 8, 128, 14336, 128256
MATMUL = H * A * D + 2 * H * G * D + A * D * H + 3 * H * F  # 218,103,808
WEIGHT_BYTES_FP16 = 2 * MATMUL + 2 * (2 * H)  # matmuls + two RMSNorms
ACT_ELEMS = (7 * H + (A + 2 * G) * D + 3 * A * D) + (7 * H + 6 * F)
KV_PER_TOKEN = 2 * G * D * 2
A100_FP16, A100_INT8, A100_BW = 312e12, 624e12, 2039e9


def test_decode_layer_by_hand():
    model, gpu = load_model("llama-3-8b"), get_gpu("A100-80G")
    work = stage_decode_work(model, gpu, ["layer"], ["fp16"], 1, 1000)
    flops = 2 * MATMUL + 4 * A * D * 1000
    n_bytes = WEIGHT_BYTES_FP16 + 2 * ACT_ELEMS + KV_PER_TOKEN * 1000
    assert work.flops == pytest.approx(flops)
    assert work.n_bytes == pytest.approx(n_bytes)
    got = utilization(work, 1e-3, gpu)
    assert got.mfu == pytest.approx(flops / (1e-3 * A100_FP16))
    assert got.mbu == pytest.approx(n_bytes / (1e-3 * A100_BW))


def test_two_layers_and_lm_head_on_last_stage():
    model, gpu = load_model("llama-3-8b"), get_gpu("A100-80G")
    one = stage_decode_work(model, gpu, ["layer"], ["fp16"], 4, 400)
    last = stage_decode_work(model, gpu, ["layer", "layer"], ["fp16", "fp16"], 4, 400, last=True)
    head_flops = 2 * 4 * H * V
    head_bytes = (V * H + H) * 2 + 4 * (3 * H + V) * 2
    assert last.flops == pytest.approx(2 * one.flops + head_flops)
    assert last.n_bytes == pytest.approx(2 * one.n_bytes + head_bytes)


def test_attention_and_mlp_blocks_add_up_to_a_layer():
    model, gpu = load_model("llama-3-8b"), get_gpu("A100-80G")
    layer = stage_decode_work(model, gpu, ["layer"], ["fp16"], 8, 8 * 512)
    blocks = stage_decode_work(model, gpu, ["attention", "mlp"], ["fp16", "fp16"], 8, 8 * 512)
    assert blocks.flops == pytest.approx(layer.flops)
    assert blocks.n_bytes == pytest.approx(layer.n_bytes)


def test_mixed_precision_counts_each_gemm_at_its_own_peak():
    model, gpu = load_model("llama-3-8b"), get_gpu("A100-80G")
    work = stage_decode_work(model, gpu, ["layer", "layer"], ["fp16", "int8"], 1, 0)
    expected_peak_s = 2 * MATMUL / A100_FP16 + 2 * MATMUL / A100_INT8
    assert work.peak_s == pytest.approx(expected_peak_s)
    assert utilization(work, 1.0, gpu).mfu == pytest.approx(expected_peak_s)


def test_prefill_by_hand():
    model, gpu = load_model("llama-3-8b"), get_gpu("A100-80G")
    work = stage_prefill_work(model, gpu, ["layer"], ["fp16"], 100, 0, batch_size=2)
    flops = 2 * 200 * MATMUL + 4 * A * D * 2 * (100 * 50)
    assert work.flops == pytest.approx(flops)
    assert work.n_bytes == pytest.approx(WEIGHT_BYTES_FP16 + 200 * 2 * ACT_ELEMS + KV_PER_TOKEN * 200)


def test_token_work_counts_weights_once_per_batch():
    model, gpu = load_model("llama-3-8b"), get_gpu("A100-80G")
    work = stage_token_work(model, gpu, 3, "fp16", tokens=50, batches=10)
    assert work.flops == pytest.approx(3 * 2 * 50 * MATMUL)
    assert work.n_bytes == pytest.approx(3 * (10 * WEIGHT_BYTES_FP16 + 50 * 2 * ACT_ELEMS))
    got = utilization(work, 2.0, gpu)
    assert got.mfu == pytest.approx(3 * 2 * 50 * MATMUL / (2.0 * A100_FP16))


def test_no_time_gives_nan_and_bad_input_is_named():
    model, gpu = load_model("llama-3-8b"), get_gpu("A100-80G")
    assert math.isnan(utilization(stage_token_work(model, gpu, 1, "fp16", 0, 0), 0.0, gpu).mfu)
    with pytest.raises(TesselError, match="2 units was given 1 precisions"):
        stage_decode_work(model, gpu, ["layer", "layer"], ["fp16"], 1, 1)
    with pytest.raises(TesselError, match="negative stage counters"):
        stage_token_work(model, gpu, 1, "fp16", -1, 0)
