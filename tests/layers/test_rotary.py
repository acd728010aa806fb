"""Rotary embedding (default, linear and llama3 scaling) against HF's rope functions."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tessel.errors import TesselError
from tessel.layers.rotary import RopeScaling, RotaryEmbedding, inverse_frequencies

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
]


def hf_config(head_dim: int, theta: float, scaling: dict | None) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=512,
        rope_theta=theta,
        rope_scaling=dict(scaling) if scaling else None,
    )


def ours(scaling: dict | None) -> RopeScaling | None:
    if scaling is None:
        return None
    return RopeScaling(**scaling)


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3"])
@pytest.mark.parametrize("head_dim, theta", [(16, 10000.0), (64, 500000.0), (6, 10.0)])
def test_inverse_frequencies_match_hf(scaling: dict | None, head_dim: int, theta: float) -> None:
    config = hf_config(head_dim, theta, scaling)
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "default":
        expected = LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    else:
        expected = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")[0]
    torch.testing.assert_close(inverse_frequencies(head_dim, theta, ours(scaling)), expected, rtol=0, atol=0)


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3"])
def test_rotated_q_k_match_hf_apply_rotary_pos_emb(scaling: dict | None) -> None:
    head_dim, tokens = 32, 37
    config = hf_config(head_dim, 10000.0, scaling)
    positions = torch.randint(0, 512, (tokens,))
    q, k = torch.randn(tokens, 4, head_dim), torch.randn(tokens, 2, head_dim)
    hf_rope = LlamaRotaryEmbedding(config)
    cos, sin = hf_rope(q, positions[None])
    # HF wants [B, H, S, D]
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rope = RotaryEmbedding(head_dim, 512, 10000.0, ours(scaling))
    gq, gk = rope(positions, q, k)
    torch.testing.assert_close(gq, hq[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gk, hk[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_unknown_rope_type_is_a_user_error() -> None:
    with pytest.raises(TesselError, match="yarn"):
        RopeScaling(rope_type="yarn", factor=2.0)


@pytest.mark.parametrize("rotary_dim", [32, 16])  # 16 of 32: partial rotary, the rest passes through
@pytest.mark.parametrize("inference", [True, False])
def test_rotate_qk_equals_forward_bit_for_bit(rotary_dim: int, inference: bool) -> None:
    """q and k heads rotated side by side (a view of a fused qkv row, as LlamaAttention passes them)
    equal `forward` on q and k apart; HF is `forward`'s oracle above."""
    tokens, hq, hkv, head_dim = 7, 4, 2, 32
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim)
    qk = qkv[:, : (hq + hkv) * head_dim].view(tokens, hq + hkv, head_dim)
    positions = torch.randint(0, 512, (tokens,))
    rope = RotaryEmbedding(rotary_dim, 512, 10000.0)
    with torch.inference_mode(inference):
        q, k = rope.rotate_qk(positions, qk, hq)
        want_q, want_k = rope(positions, qk[:, :hq], qk[:, hq:])
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert q.shape == (tokens, hq, head_dim) and k.shape == (tokens, hkv, head_dim)
