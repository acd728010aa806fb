"""A tensor-parallel rank loads only its slices: the bytes it reads are its share of the split
tensors (through the safetensors slice API, never `get_tensor`), and the ranks' weights put
together are the one-process model's."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tessel.models.config import ModelConfig
from tessel.models.loader import load_model
from tessel.models.reader import checkpoint_files
from tessel.parallel.group import TPGroup
from tessel.parallel.load import load_rank
from tessel.parallel.split import TPSplit


def _ranks(path, degree: int):  # noqa: ANN001, ANN202
    split = TPSplit.of(ModelConfig.from_dir(path), degree)
    cpu = torch.device("cpu")
    return split, [load_rank(path, torch.float32, TPGroup(r, degree, cpu), split) for r in range(degree)]


def _checkpoint_bytes(path) -> tuple[int, int]:  # noqa: ANN001
    """(all tensor bytes, bytes of the tensors every rank reads whole)."""
    total = whole = 0
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
                if "norm" in name:
                    whole += t.numel() * t.element_size()
    return total, whole


@pytest.mark.parametrize("name", ["llama", "llama31_tied", "phi3"])
def test_ranks_read_only_their_share(checkpoints, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = checkpoints(name)
    whole_reads: list[str] = []
    original = type(safe_open(str(checkpoint_files(path)[0]), framework="pt")).get_tensor

    def spy(self, key):  # noqa: ANN001, ANN202
        whole_reads.append(key)
        return original(self, key)

    monkeypatch.setattr(type(safe_open(str(checkpoint_files(path)[0]), framework="pt")), "get_tensor", spy)
    _, ranks = _ranks(path, 2)
    monkeypatch.undo()
    assert whole_reads == []  # every tensor read through get_slice
    total, whole = _checkpoint_bytes(path)
    split_bytes = total - whole
    for rank in ranks:
        assert rank.bytes_read < whole + 0.6 * split_bytes  # about half of every split tensor
    assert sum(r.bytes_read for r in ranks) == pytest.approx(total + whole, rel=0.01)


def test_rank_weights_together_are_the_model(checkpoints) -> None:
    path = checkpoints("llama")
    full = load_model(path, torch.float32)
    split, ranks = _ranks(path, 2)
    models = [r.model for r in ranks]
    layer = [m.model.layers[1] for m in models]
    c = full.config
    q, k, v = full.model.layers[1].self_attn.qkv_proj.weight.split([c.q_size, c.kv_size, c.kv_size])
    parts = [lay.self_attn.qkv_proj.weight for lay in layer]
    local = [split.local_config(c, r) for r in range(2)]
    pieces = [p.split([lc.q_size, lc.kv_size, lc.kv_size]) for p, lc in zip(parts, local, strict=True)]
    assert torch.equal(torch.cat([p[0] for p in pieces]), q)
    assert torch.equal(torch.cat([p[1] for p in pieces]), k)
    assert torch.equal(torch.cat([p[2] for p in pieces]), v)
    o = torch.cat([lay.self_attn.o_proj.inner.weight for lay in layer], dim=1)
    assert torch.equal(o, full.model.layers[1].self_attn.o_proj.weight)
    down = torch.cat([lay.mlp.down_proj.inner.weight for lay in layer], dim=1)
    assert torch.equal(down, full.model.layers[1].mlp.down_proj.weight)
    embed = torch.cat([m.model.embed_tokens.weight for m in models])[: c.vocab_size]
    assert torch.equal(embed, full.model.embed_tokens.weight)
    head = torch.cat([m.lm_head.inner.weight for m in models])
    assert torch.equal(head[: c.vocab_size], full.lm_head.weight)
    assert not head[c.vocab_size :].any()  # padding rows
