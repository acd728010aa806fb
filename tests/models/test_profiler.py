"""The profiler times the engine's own layer (against an SDPA float64 reference), its point
choice, and a real run."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tessel.cost.profile import PREFILL_BATCH, load_profile  # noqa: E402
from tessel.errors import TesselError  # noqa: E402
from tessel.layers.linear import Linear  # noqa: E402
from tessel.models.llama import LlamaDecoderLayer  # noqa: E402
from tessel.profiling.layer import (  # noqa: E402
    LayerShape,
    ProfileSettings,
    _Layer,
    catalog_name_for,
    choose_points,
    parse_tiny_shape,
    prefill_grid,
    profile_layer,
)

F = torch.nn.functional


def reference(layer: _Layer, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The decoder layer over a whole sequence [T, h] (positions 0..T-1), in float64 with SDPA:
    fused add + RMSNorm, q/k/v, rotate-half RoPE, causal GQA, o_proj, add + RMSNorm, SwiGLU."""
    m, shape = layer.module, layer.shape
    a, g, d, T = shape.num_heads, shape.num_kv_heads, shape.head_dim, x.shape[0]
    w = {name: p.double() for name, p in m.named_parameters()}
    eps = m.input_layernorm.eps

    def rms(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(t: torch.Tensor) -> torch.Tensor:
        cos, sin = layer.rotary.cos[:T, None].double(), layer.rotary.sin[:T, None].double()
        t1, t2 = t[..., : d // 2], t[..., d // 2 :]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)

    r1 = x.double() + residual.double()
    q, k, v = F.linear(rms(r1, w["input_layernorm.weight"]), w["self_attn.qkv_proj.weight"]).split(
        [a * d, g * d, g * d], dim=-1
    )
    q, k, v = rope(q.view(T, a, d)), rope(k.view(T, g, d)), v.view(T, g, d)
    k, v = k.repeat_interleave(a // g, dim=1), v.repeat_interleave(a // g, dim=1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    r2 = F.linear(o.transpose(0, 1).reshape(T, a * d), w["self_attn.o_proj.weight"]) + r1
    gate, up = F.linear(rms(r2, w["post_attention_layernorm.weight"]), w["mlp.gate_up_proj.weight"]).chunk(
        2, -1
    )
    return F.linear(F.silu(gate) * up, w["mlp.down_proj.weight"]) + r2


def test_the_timed_layer_is_the_engines() -> None:
    layer = _Layer(LayerShape(64, 96, 4, 2, 16), ProfileSettings(), max_tokens=64, max_batch=2)
    assert isinstance(layer.module, LlamaDecoderLayer)
    if torch.backends.mkldnn.is_available():  # float32 on CPU: packed as ModelRunner packs it
        gate_up = layer.module.mlp.gate_up_proj
        assert isinstance(gate_up, Linear) and gate_up.path == "packed"


@pytest.mark.parametrize(
    "shape", [LayerShape(64, 96, 4, 2, 16), LayerShape(48, 80, 3, 3, 16), LayerShape(32, 40, 4, 1, 8)]
)
def test_chunked_prefill_through_the_paged_cache_equals_the_reference(shape: LayerShape) -> None:
    """Prefill in chunks (k/v into random blocks of the pool, then read back as a prefix) = one
    causal pass of the float64 reference."""
    total = 37
    with torch.inference_mode():
        layer = _Layer(shape, ProfileSettings(seed=3), max_tokens=64, max_batch=2, pack_cpu_linears=False)
        x, residual = torch.randn(total, shape.hidden_size), torch.randn(total, shape.hidden_size)
        pieces, start = [], 0
        for size in (5, 13, 1, 18):
            rows = slice(start, start + size)
            inputs = layer.prefill_inputs(size, start, seq=1, x=x[rows], residual=residual[rows])
            pieces.append(layer.forward(*inputs))
            start += size
        expected = reference(layer, x, residual)
        torch.testing.assert_close(torch.cat(pieces).double(), expected, rtol=1e-4, atol=1e-4)


def test_decode_step_equals_last_row_of_the_reference() -> None:
    shape = LayerShape(64, 96, 4, 2, 16)
    with torch.inference_mode():
        layer = _Layer(shape, ProfileSettings(), max_tokens=32, max_batch=2, pack_cpu_linears=False)
        x, residual = torch.randn(2, 20, 64), torch.randn(2, 20, 64)
        for seq in range(2):
            layer.forward(*layer.prefill_inputs(19, 0, seq=seq, x=x[seq, :19], residual=residual[seq, :19]))
        inputs = layer.decode_inputs(2, 19, x=x[:, 19], residual=residual[:, 19])
        assert inputs[3].decode_groups[0].gather is not None  # the engine's batched CPU form, timed
        step = layer.forward(*inputs)
        for seq in range(2):
            expected = reference(layer, x[seq], residual[seq])[19]
            torch.testing.assert_close(step[seq].double(), expected, rtol=1e-4, atol=1e-4)


def test_a_pass_over_several_prompts_equals_each_prompt_alone() -> None:
    """The prefill-batch point (n prompts' chunks in one pass) computes what n separate causal
    passes of the float64 reference do."""
    shape = LayerShape(64, 96, 4, 2, 16)
    with torch.inference_mode():
        layer = _Layer(shape, ProfileSettings(seed=5), max_tokens=32, max_batch=3, pack_cpu_linears=False)
        positions, x, residual, meta = layer.prefill_batch_inputs(3, 7)
        assert positions.tolist() == list(range(7)) * 3 and len(meta.prefills) == 3
        out = layer.forward(positions, x, residual, meta)
        for seq in range(3):
            rows = slice(7 * seq, 7 * seq + 7)
            expected = reference(layer, x[rows].clone(), residual[rows].clone())
            torch.testing.assert_close(out[rows].double(), expected, rtol=1e-4, atol=1e-4)


def test_choose_points_fits_the_budget_and_spreads() -> None:
    rng = np.random.default_rng(0)
    points = prefill_grid(ProfileSettings(max_chunk_tokens=1024, max_offset_tokens=4096))
    costs = {pt: float(rng.uniform(0.01, 1.0)) * pt[0] for pt in points}
    for budget in (5.0, 50.0, 500.0):
        chosen = choose_points(points, lambda c, p: costs[(c, p)], budget, minimum=8)
        assert set(chosen) <= set(points) and len(set(chosen)) == len(chosen)
        assert len(chosen) >= 8
        assert sum(costs[pt] for pt in chosen) <= budget or len(chosen) == 8
    everything = choose_points(points, lambda c, p: costs[(c, p)], 1e9, minimum=8)
    assert everything == points


def test_shapes() -> None:
    scaled = LayerShape(4096, 14336, 32, 8, 128).scaled(4)
    assert scaled == LayerShape(1024, 3584, 8, 2, 128)
    assert LayerShape(4096, 14336, 32, 8, 128).scaled(16).num_kv_heads == 1
    assert parse_tiny_shape("256,768,4,2") == LayerShape(256, 768, 4, 2, 64)
    with pytest.raises(TesselError):
        parse_tiny_shape("256,768,3,2")
    with pytest.raises(TesselError):
        parse_tiny_shape("a,b")
    with pytest.raises(TesselError):
        LayerShape(64, 64, 4, 3, 16)


def test_tiny_profile_end_to_end(tmp_path) -> None:
    """A real (small) profiling run: measured, fitted, saved, loaded back."""
    settings = ProfileSettings(
        budget_s=1.0, max_chunk_tokens=64, max_offset_tokens=256, max_decode_batch=4, max_decode_context=256
    )
    result, report, data = profile_layer(LayerShape(64, 128, 4, 2, 16), settings, meta={"source": "test"})
    assert len(data.prefill_times_s) >= 8 and len(data.decode_times_s) >= 6
    assert (data.prefill_times_s > 0).all() and (data.decode_times_s > 0).all()
    assert result.device_type == "cpu" and result.dtype == "fp32"
    assert np.isfinite(result.heldout_rel_error) and result.heldout_rel_error == report.heldout_error
    assert min(result.prefill.a0, result.prefill.a1, result.prefill.a2, result.prefill.a3) >= 0
    assert result.meta["clock"] == "cpu" and result.meta["threads"] == "1"
    batch = result.components[PREFILL_BATCH]  # passes of 1..16 prompts' 32-token chunks
    assert batch.unit == "sequences" and batch.n_points == len(data.prefill_batch_sizes) >= 7
    assert batch.c1 > 0 and np.isfinite(batch.heldout_rel_error)
    path = tmp_path / "profile.json"
    result.save(path)
    assert load_profile(path) == replace(result, meta=result.to_json()["meta"])  # + the writer's version
    assert json.loads(path.read_text())["model_shape"]["head_dim"] == 16


def test_contention_is_the_layer_beside_a_co_runner() -> None:
    """`tessel.profiling.contention`: a co-runner process runs the same layer; the component is the
    slowdown factor per co-runner (c0 = 1: none alone), from interleaved rounds each way."""
    from functools import partial

    from tessel.profiling.contention import CONTENTION_DECODE, DECODE_POINT, MAX_TOKENS, measure_contention
    from tessel.profiling.layer import _Layer
    from tessel.profiling.timing import make_clock

    make_layer = partial(
        _Layer, LayerShape(64, 128, 4, 2, 16), ProfileSettings(), MAX_TOKENS, DECODE_POINT[0]
    )
    fits = measure_contention(make_layer, 1, make_clock("cpu"))
    fit = fits[CONTENTION_DECODE]
    assert set(fits) == {CONTENTION_DECODE} and fit.unit == "co-runners"
    assert fit.c0 == 1.0 and 0.0 <= fit.c1 < 10.0 and fit.time_s(0) == 1.0


def test_the_cli_profile_times_contention_only_for_a_model_on_a_cpu_with_room() -> None:
    from tessel.profiling.components import host_cores
    from tessel.profiling.layer import contends

    assert not contends(ProfileSettings())  # not asked (the Python API's default)
    assert contends(ProfileSettings(contention=True)) == (host_cores() >= 2)
    assert not contends(ProfileSettings(contention=True, device="cuda"))
    assert not contends(ProfileSettings(contention=True, threads=host_cores()))


def test_cuda_without_a_gpu_is_a_user_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(TesselError, match="CUDA"):
        profile_layer(LayerShape(64, 128, 4, 2, 16), ProfileSettings(device="cuda"))


@pytest.mark.parametrize(
    "cuda_name,expected",
    [
        ("NVIDIA A100-SXM4-80GB", "A100-80G"),
        ("NVIDIA A100-PCIE-40GB", "A100-40G"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("Tesla V100-SXM2-32GB", "V100-32G"),
        ("Tesla V100-PCIE-16GB", "V100-16G"),
        ("Tesla T4", "T4"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("NVIDIA B200", None),
    ],
)
def test_cuda_names_map_to_the_catalog(cuda_name: str, expected: str | None) -> None:
    from tessel.catalog.gpus import known_gpus

    assert catalog_name_for(cuda_name, known_gpus()) == expected
