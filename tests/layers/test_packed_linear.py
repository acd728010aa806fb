"""The packed `Linear` (oneDNN-reordered weights) against a float64 linear, and pack_linears' swaps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessel.layers.embedding import LMHead
from tessel.layers.linear import (
    TILE_ROWS,
    Linear,
    pack_linears,
    packed_bucket_rows,
    packed_linear,
    packing_available,
)

pytestmark = pytest.mark.skipif(not packing_available(), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 5, 32, 123, TILE_ROWS, TILE_ROWS + 1, 2 * TILE_ROWS + 77])
@pytest.mark.parametrize("in_features, out_features", [(7, 3), (64, 96), (123, 257)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_float64(rows, in_features, out_features, bias) -> None:
    layer = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(rows, in_features)
    expected = x.double() @ layer.weight.double().t()
    if bias:
        expected += layer.bias.double()
    out = packed_linear(layer.weight, layer.bias)(x)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_row_buckets_cover_every_count_with_few_shapes() -> None:
    buckets = [packed_bucket_rows(n) for n in range(1, TILE_ROWS + 1)]
    assert all(n <= b <= TILE_ROWS for n, b in zip(range(1, TILE_ROWS + 1), buckets, strict=True))
    assert (
        buckets[:33] == sorted(buckets[:33]) and packed_bucket_rows(32) == 32 and packed_bucket_rows(31) == 32
    )
    assert len(set(buckets)) <= 13


def test_leading_dims_and_strided_rows() -> None:
    layer = nn.Linear(40, 24)
    packed = packed_linear(layer.weight, layer.bias)
    x = torch.randn(3, 5, 40)
    torch.testing.assert_close(packed(x), layer(x), atol=1e-5, rtol=1e-5)
    strided = torch.randn(6, 80)[:, :40]
    torch.testing.assert_close(packed(strided), layer(strided), atol=1e-5, rtol=1e-5)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.inner = nn.Sequential(nn.Linear(32, 32, bias=False), nn.ReLU())
        self.bf16 = nn.Linear(32, 8).to(torch.bfloat16)  # not float32: left alone
        self.head = LMHead(50, 32)
        nn.init.normal_(self.head.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(self.proj(x)))


def _packed(module: nn.Module) -> bool:
    return isinstance(module, Linear) and module.path == "packed" and module.weight is None


def test_pack_linears_swaps_float32_layers_and_keeps_outputs() -> None:
    model = _Tiny()
    x = torch.randn(9, 16)
    expected = model(x)
    assert pack_linears(model) == 3
    assert _packed(model.proj) and _packed(model.inner[0]) and _packed(model.head)
    assert type(model.bf16) is nn.Linear
    assert pack_linears(model) == 0  # packed layers are not packed again
    with torch.inference_mode():
        out = model(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_engine_can_leave_linears_unpacked(tmp_path) -> None:
    from tessel import LLM
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    packed = LLM(str(path), max_model_len=64)
    plain = LLM(str(path), max_model_len=64, pack_cpu_linears=False)
    count = [sum(_packed(m) for m in llm.model.modules()) for llm in (packed, plain)]
    assert count[0] > 0 and count[1] == 0
