"""Which part each tensor-parallel rank holds: the split covers the model exactly once, slices of
every checkpoint tensor concatenate back to it, and degrees that cannot split are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tessel.errors import TesselError
from tessel.models.config import ModelConfig
from tessel.parallel.shard_rules import slice_of
from tessel.parallel.split import TPSplit

BASE = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=101,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=8,
    max_position_embeddings=64,
)


def config(**changes) -> ModelConfig:
    return dataclasses.replace(BASE, **changes)


@pytest.mark.parametrize("degree", [1, 2, 3])
def test_split_covers_heads_columns_and_vocabulary_once(degree: int) -> None:
    split = TPSplit.of(BASE, degree)
    shards = split.shards
    assert [s.kv_start for s in shards[1:]] == [s.kv_stop for s in shards[:-1]]
    assert shards[0].kv_start == 0 and shards[-1].kv_stop == BASE.num_key_value_heads
    assert sum(s.num_heads for s in shards) == BASE.num_attention_heads
    assert [s.inter_start for s in shards[1:]] == [s.inter_stop for s in shards[:-1]]
    assert shards[-1].inter_stop == BASE.intermediate_size and all(s.intermediate_size > 0 for s in shards)
    assert sum(s.vocab_rows for s in shards) >= BASE.vocab_size > sum(s.vocab_rows for s in shards[:-1])
    local = split.local_config(BASE, degree - 1)
    assert local.num_key_value_heads == shards[-1].num_kv_heads and local.head_dim == BASE.head_dim


def test_uneven_kv_heads_keep_the_mlp_even() -> None:
    """3 KV heads over 2 ranks: 2 + 1; the MLP columns stay even (the ranks meet after each half of
    a layer, so moving columns to the rank with fewer heads would only lengthen the MLP's slowest
    share), an odd width the larger share first."""
    shards = TPSplit.of(config(intermediate_size=1536, hidden_size=576, head_dim=64), 2).shards
    assert [s.num_kv_heads for s in shards] == [2, 1]
    assert [s.intermediate_size for s in shards] == [768, 768]
    odd = TPSplit.of(config(intermediate_size=1537, hidden_size=576, head_dim=64), 2).shards
    assert [s.intermediate_size for s in odd] == [769, 768]


def _checkpoint_tensor(name: str, c: ModelConfig) -> torch.Tensor:
    shapes = {
        "q_proj.weight": (c.q_size, c.hidden_size),
        "k_proj.weight": (c.kv_size, c.hidden_size),
        "q_proj.bias": (c.q_size,),
        "qkv_proj.weight": (c.q_size + 2 * c.kv_size, c.hidden_size),
        "o_proj.weight": (c.hidden_size, c.q_size),
        "gate_up_proj.weight": (2 * c.intermediate_size, c.hidden_size),
        "up_proj.weight": (c.intermediate_size, c.hidden_size),
        "down_proj.weight": (c.hidden_size, c.intermediate_size),
        "embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
    }
    return torch.randn(shapes[".".join(name.split(".")[-2:])])


def _read(tensor: torch.Tensor, piece) -> torch.Tensor:  # noqa: ANN001
    runs = [tensor[a:b] if piece.dim == 0 else tensor[:, a:b] for a, b in piece.runs]
    return torch.cat(runs, dim=piece.dim)


NAMES = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.q_proj.bias",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
]


@pytest.mark.parametrize("degree", [2, 3])
@pytest.mark.parametrize("name", NAMES)
def test_rank_slices_concatenate_back_to_the_tensor(name: str, degree: int) -> None:
    full = _checkpoint_tensor(name, BASE)
    split = TPSplit.of(BASE, degree)
    pieces = [slice_of(name, BASE, shard) for shard in split.shards]
    dim = pieces[0].dim
    assert torch.equal(torch.cat([_read(full, p) for p in pieces], dim=dim), full)


def test_fused_qkv_and_gate_up_take_each_part_of_the_rank() -> None:
    c = config(fused_checkpoint=True)
    split = TPSplit.of(c, 3)
    qkv = _checkpoint_tensor("model.layers.0.self_attn.qkv_proj.weight", c)
    q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size])
    for shard in split.shards:
        got = _read(qkv, slice_of("model.layers.0.self_attn.qkv_proj.weight", c, shard))
        d = c.head_dim
        want = torch.cat(
            [
                q[shard.q_start * d : (shard.q_start + shard.num_heads) * d],
                k[shard.kv_start * d : shard.kv_stop * d],
                v[shard.kv_start * d : shard.kv_stop * d],
            ]
        )
        assert torch.equal(got, want)
    gate_up = _checkpoint_tensor("model.layers.0.mlp.gate_up_proj.weight", c)
    gate, up = gate_up.chunk(2)
    shard = split.shards[1]
    got = _read(gate_up, slice_of("model.layers.0.mlp.gate_up_proj.weight", c, shard))
    cols = slice(shard.inter_start, shard.inter_stop)
    assert torch.equal(got, torch.cat([gate[cols], up[cols]]))


def test_row_parallel_bias_on_the_leader_and_norms_whole() -> None:
    shards = TPSplit.of(BASE, 2).shards
    assert slice_of("model.layers.0.self_attn.o_proj.bias", BASE, shards[1]).leader_only
    assert slice_of("model.layers.0.mlp.down_proj.bias", BASE, shards[0]).leader_only
    assert slice_of("model.layers.0.input_layernorm.weight", BASE, shards[1]) is None
    assert slice_of("model.norm.weight", BASE, shards[1]) is None


@pytest.mark.parametrize(
    ("changes", "degree", "words"),
    [
        ({}, 4, ["degree 4", "3 KV heads", "6 attention heads", "at most 3"]),
        ({"num_attention_heads": 7}, 2, ["7 attention heads", "3 KV heads"]),
        ({"num_experts": 4, "num_experts_per_tok": 2}, 2, ["mixture-of-experts", "4 experts"]),
        ({}, 0, ["must be >= 1"]),
    ],
)
def test_degrees_that_cannot_split_are_refused(changes: dict, degree: int, words: list[str]) -> None:
    with pytest.raises(TesselError) as error:
        TPSplit.of(config(**changes), degree, where="stage 1")
    assert "stage 1" in str(error.value)
    for word in words:
        assert word in str(error.value)
