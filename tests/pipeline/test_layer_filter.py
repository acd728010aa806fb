"""Per-stage loading: a stage holds exactly its tensors of the checkpoint, and its layers compute as
the whole model's do."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tessel.models.layer_filter import LayerFilter
from tessel.models.loader import checkpoint_files, load_model


def checkpoint_bytes(model_dir, part: LayerFilter) -> int:
    """Oracle: bytes of the checkpoint tensors a stage must hold, read from the safetensors files."""
    total = 0
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name == "lm_head.weight" and part.tied:
                    continue
                if part.holds(name):
                    tensor = f.get_slice(name)
                    numel = 1
                    for size in tensor.get_shape():
                        numel *= size
                    total += numel * 4
    return total


@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("untied", LayerFilter(0, 2, embed=True, head=False)),
        ("untied", LayerFilter(2, 3, embed=False, head=False)),
        ("untied", LayerFilter(3, 6, embed=False, head=True)),
        ("tied", LayerFilter(1, 5, embed=False, head=True, tied=True)),
        ("tied", LayerFilter(0, 5, embed=True, head=True, tied=True)),
    ],
)
def test_stage_loads_only_its_tensors(tiny_dirs, name, part):
    model = load_model(tiny_dirs[name], torch.float32, layers=part)
    params = {n: p for n, p in model.named_parameters()}
    held_layers = {int(n.split(".")[2]) for n in params if n.startswith("model.layers.")}
    assert held_layers == set(range(part.layer_start, part.layer_end))
    assert ("model.embed_tokens.weight" in params) == part.needs_embedding
    assert ("model.norm.weight" in params) == part.head
    assert any(p.is_meta for p in params.values()) is False
    assert sum(p.numel() * p.element_size() for p in params.values()) == checkpoint_bytes(
        tiny_dirs[name], part
    )
    if part.head and part.tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_stage_layers_equal_the_whole_model(tiny_dirs):
    """Oracle: the full model's own layers on the same weights, run one after another."""
    path = tiny_dirs["untied"]
    whole = load_model(path, torch.float32)
    part = load_model(path, torch.float32, layers=LayerFilter(2, 4, embed=False, head=False))
    for index in (2, 3):
        for (n1, p1), (n2, p2) in zip(
            whole.model.layers[index].named_parameters(),
            part.model.layers[index].named_parameters(),
            strict=True,
        ):
            assert n1 == n2 and torch.equal(p1, p2)
    assert isinstance(part.model.layers[0], torch.nn.Identity)


def test_holds_names():
    part = LayerFilter(3, 7, embed=False, head=True, tied=True)
    assert part.holds("model.layers.3.mlp.down_proj.weight")
    assert not part.holds("model.layers.2.mlp.down_proj.weight")
    assert not part.holds("model.layers.7.self_attn.q_proj.weight")
    assert part.holds("model.layers.6.input_layernorm.weight")
    assert part.holds("model.embed_tokens.weight")  # tied: the head is the embedding
    assert part.holds("model.norm.weight") and part.holds("lm_head.weight")
    untied_middle = LayerFilter(1, 2, embed=False, head=False)
    assert not untied_middle.holds("model.embed_tokens.weight")
    assert not untied_middle.holds("lm_head.weight")
    with pytest.raises(ValueError):
        LayerFilter(4, 4, embed=True, head=True)
