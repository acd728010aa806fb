"""The one model reader (`tessel.models.reader.read_model`): what it accepts is what the loader loads,
what it refuses is refused before a model is built, with one line naming the file and the field.

Oracle for the accepted side: the `safetensors` library's own view of the same files (tensor names,
shapes, byte counts) and the loader loading them.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hostile_models
import tiny_models
from tessel import LLM
from tessel.errors import TesselError
from tessel.models.loader import load_model
from tessel.models.reader import read_model

VARIANTS = sorted(tiny_models.VARIANTS)


@pytest.mark.parametrize("name", VARIANTS)
def test_every_tiny_variant_reads_as_safetensors_sees_it(checkpoints, name: str) -> None:
    path = checkpoints(name)
    model = read_model(path)
    seen, data_bytes = {}, 0
    for file in model.files:
        with safe_open(str(file), framework="pt") as f:
            seen |= {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        (header_bytes,) = struct.unpack("<Q", file.read_bytes()[:8])
        data_bytes += file.stat().st_size - 8 - header_bytes
    assert {n: t.shape for n, t in model.tensors.items()} == seen
    assert model.weight_bytes == data_bytes
    assert (
        model.config.num_hidden_layers == json.loads((path / "config.json").read_text())["num_hidden_layers"]
    )


@pytest.fixture
def no_model_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    def built(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a model was built for a model directory the reader should refuse")

    monkeypatch.setattr("tessel.models.loader.LlamaForCausalLM", built)


@pytest.mark.parametrize("name", sorted(hostile_models.FINDINGS))
def test_the_python_api_refuses_a_broken_model_before_building_it(
    checkpoints, tmp_path: Path, name: str, no_model_is_built
) -> None:
    edit, file, field = hostile_models.FINDINGS[name]
    model = hostile_models.broken_copy(checkpoints("llama"), tmp_path / "m", edit)
    for attempt in (read_model, LLM):
        with pytest.raises(TesselError) as error:
            attempt(model)
        message = str(error.value)
        assert "\n" not in message and str(model / file) in message and field in message, message


def _rewrite(path: Path, change) -> None:  # noqa: ANN001
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), {"format": "pt"})


def _copy(checkpoints, tmp_path: Path, name: str = "llama") -> Path:
    return Path(shutil.copytree(checkpoints(name), tmp_path / name))


def test_a_missing_layer_tensor_is_named(checkpoints, tmp_path: Path) -> None:
    path = _copy(checkpoints, tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(TesselError, match=r"lacks 1 tensor\(s\).*model\.layers\.1\.mlp\.up_proj\.weight"):
        read_model(path)


def test_layers_on_disk_that_config_does_not_count_are_unexpected(checkpoints, tmp_path: Path) -> None:
    path = _copy(checkpoints, tmp_path)
    hostile_models.edit_config(num_hidden_layers=1)(path)
    with pytest.raises(TesselError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.1\."):
        read_model(path)


def test_an_integer_float_weight_and_an_unannounced_bias_are_refused(checkpoints, tmp_path: Path) -> None:
    path = _copy(checkpoints, tmp_path)
    _rewrite(path, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].int()}))
    with pytest.raises(TesselError, match=r"'model\.norm\.weight' is I32; tessel reads it as BF16 or F16"):
        read_model(path)
    path = _copy(checkpoints, tmp_path / "bias")
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}))
    with pytest.raises(TesselError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.o_proj\.bias'"):
        read_model(path)


def test_a_tensor_in_two_shards_is_refused(checkpoints, tmp_path: Path) -> None:
    path = _copy(checkpoints, tmp_path, "llama_sharded")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    tensors = load_file(str(path / second))
    tensors["model.norm.weight"] = torch.ones(64)
    save_file(tensors, str(path / second))
    norm_file = index["weight_map"]["model.norm.weight"]
    if norm_file == second:  # it was there already: put the copy in the first shard
        tensors = load_file(str(path / first)) | {"model.norm.weight": torch.ones(64)}
        save_file(tensors, str(path / first))
    with pytest.raises(TesselError, match=r"tensor 'model\.norm\.weight' is also in"):
        read_model(path)


def test_a_gguf_file_reads_as_its_checkpoint(checkpoints, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("gguf")
    import tiny_gguf

    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tiny_gguf.write_tiny_gguf(checkpoints("llama"), tmp_path / "tiny.gguf")
    model = read_model(gguf_file)
    assert model.path.parent == tmp_path / "cache" / "gguf"
    assert model.tensors.keys() == read_model(checkpoints("llama")).tensors.keys()
    ours = load_model(gguf_file, torch.float32).state_dict()
    reference = load_model(checkpoints("llama"), torch.float32).state_dict()
    assert all(torch.equal(ours[k], reference[k]) for k in reference)


def test_paths_that_are_no_model_name_the_option(tmp_path: Path) -> None:
    (tmp_path / "file.txt").write_text("x")
    for path in (tmp_path / "missing", tmp_path / "file.txt"):
        with pytest.raises(TesselError, match=r"^MODEL .* is not a directory or a \.gguf file"):
            read_model(path, "MODEL")
    with pytest.raises(TesselError, match="has no config.json"):
        read_model(tmp_path)


def test_a_q8_0_gguf_with_an_all_zero_block_loads_with_zeros_there(
    checkpoints, tmp_path: Path, monkeypatch
) -> None:
    """llama.cpp stores d = 0 for a block of 32 zero weights; the loader refuses scales <= 0, so the
    import gives such a block codes 0 at scale 1 (the same zeros)."""
    pytest.importorskip("gguf")
    import tiny_gguf

    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path / "cache"))
    source = _copy(checkpoints, tmp_path)
    _rewrite(source, lambda t: t["model.layers.0.mlp.down_proj.weight"][2, 32:64].zero_())
    model = load_model(tiny_gguf.write_tiny_gguf(source, tmp_path / "q8.gguf", q8_0=True), torch.float32)
    assert read_model(tmp_path / "q8.gguf").scheme.name == "w8a16"
    down = model.model.layers[0].mlp.down_proj
    weight = down(torch.eye(down.in_features)).T  # [out, in] as the layer computes it
    assert torch.all(weight[2, 32:64] == 0) and torch.count_nonzero(weight[2]) > 0


def test_an_index_naming_shards_outside_the_directory_is_refused(checkpoints, tmp_path: Path) -> None:
    path = _copy(checkpoints, tmp_path, "llama_sharded")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(TesselError, match=r"shards must be files of .*elsewhere\.safetensors"):
        read_model(path)
