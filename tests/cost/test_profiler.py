"""The profiler's decoder layer (against full causal attention), its point choice, and a real run."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tessel.cost.profile import load_profile  # noqa: E402
from tessel.cost.profiler import (  # noqa: E402
    LayerShape,
    ProfileSettings,
    _Layer,
    catalog_name_for,
    choose_points,
    parse_tiny_shape,
    prefill_grid,
    profile_layer,
)
from tessel.errors import TesselError  # noqa: E402


@pytest.mark.parametrize(
    "shape", [LayerShape(64, 96, 4, 2, 16), LayerShape(48, 80, 3, 3, 16), LayerShape(32, 40, 4, 1, 8)]
)
def test_chunked_layer_equals_whole_sequence(shape: LayerShape) -> None:
    """Prefill in chunks (KV cache at an offset, lower-right causal mask) = one causal pass."""
    settings = ProfileSettings(seed=3)
    total = 37
    with torch.inference_mode():
        layer = _Layer(shape, settings, max_tokens=64, max_batch=1)
        x = torch.randn(1, total, shape.hidden_size)
        whole = layer.forward(x, 0, torch.ones(total, total).tril().bool())
        pieces, start = [], 0
        for size in (5, 13, 1, 18):
            rows = torch.arange(size)[:, None] + start
            mask = torch.arange(start + size)[None, :] <= rows
            pieces.append(layer.forward(x[:, start : start + size], start, mask))
            start += size
        torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_decode_step_equals_last_row_of_prefill() -> None:
    shape = LayerShape(64, 96, 4, 2, 16)
    with torch.inference_mode():
        layer = _Layer(shape, ProfileSettings(), max_tokens=32, max_batch=2)
        x = torch.randn(2, 20, 64)
        full = layer.forward(x, 0, torch.ones(20, 20).tril().bool())
        layer.forward(x[:, :19], 0, torch.ones(19, 19).tril().bool())
        step = layer.forward(x[:, 19:], 19, None)
        torch.testing.assert_close(step, full[:, 19:], rtol=1e-5, atol=1e-5)


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
    path = tmp_path / "profile.json"
    result.save(path)
    assert load_profile(path) == result
    assert json.loads(path.read_text())["model_shape"]["head_dim"] == 16


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


def test_prefill_inputs_mask_is_lower_right_causal() -> None:
    """The mask the timed prefill uses gives the same attention as the explicit boolean mask."""
    shape = LayerShape(64, 96, 4, 2, 16)
    with torch.inference_mode():
        layer = _Layer(shape, ProfileSettings(), max_tokens=64, max_batch=1)
        x = torch.randn(1, 40, 64)
        layer.forward(x[:, :29], 0, torch.ones(29, 29).tril().bool())
        _, offset, mask = layer.prefill_inputs(11, 29)
        timed = layer.forward(x[:, 29:], offset, mask)
        rows = torch.arange(11)[:, None] + 29
        explicit = layer.forward(x[:, 29:], 29, torch.arange(40)[None, :] <= rows)
        torch.testing.assert_close(timed, explicit)
