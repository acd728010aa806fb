"""BERT encoders and sentence embeddings: tessel's vectors against HF transformers + the pooling config."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from encoder_models import make_tiny_bert, oracle_embeddings
from tessel.errors import TesselError
from tessel.models.embedder import Embedder
from tessel.models.reader import read_encoder, read_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world!",
    "  Attention is all you need.  ",
    "One two three four five six seven eight nine ten, the cat sat on the mat and the dog sat on the log.",
    "paris",
]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny")


def _close(ours: torch.Tensor, oracle: torch.Tensor) -> None:
    assert ours.shape == oracle.shape
    assert (ours - oracle).abs().max() < 1e-5
    assert torch.nn.functional.cosine_similarity(ours, oracle).min() >= 0.99999


@pytest.mark.parametrize(
    "modes,normalize,act",
    [
        (("mean_tokens",), True, "gelu"),
        (("cls_token",), False, "gelu"),
        (("max_tokens",), True, "gelu_new"),
        (("cls_token", "mean_tokens"), False, "gelu_pytorch_tanh"),
    ],
)
def test_tiny_bert_matches_transformers(tmp_path, modes, normalize, act):
    path = make_tiny_bert(tmp_path / "m", modes=modes, normalize=normalize, hidden_act=act, seed=len(modes))
    _close(Embedder(path, batch_size=2).embed(TEXTS), oracle_embeddings(path, TEXTS))


def test_batch_size_and_order_do_not_change_vectors(tiny_bert):
    one = Embedder(tiny_bert, batch_size=1).embed(TEXTS)
    many = Embedder(tiny_bert, batch_size=8).embed(TEXTS)
    assert (one - many).abs().max() < 1e-5
    reversed_ = Embedder(tiny_bert, batch_size=3).embed(TEXTS[::-1])
    assert (reversed_.flip(0) - one).abs().max() < 1e-5


def test_plain_bert_directory_mean_pools_without_normalising(tmp_path):
    path = make_tiny_bert(tmp_path / "plain", sentence_transformers=False)
    vectors = Embedder(path).embed(TEXTS)
    _close(vectors, oracle_embeddings(path, TEXTS))
    assert not torch.allclose(vectors.norm(dim=1), torch.ones(len(TEXTS)))


def test_bert_prefixed_checkpoint_with_heads_loads(tmp_path, tiny_bert):
    path = make_tiny_bert(tmp_path / "mlm")
    weights = load_file(path / "model.safetensors")
    prefixed = {f"bert.{name}": t for name, t in weights.items()}
    prefixed["cls.predictions.bias"] = torch.zeros(3)
    save_file(prefixed, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"architectures": ["BertForMaskedLM"]}))
    direct = Embedder(tiny_bert).embed(TEXTS)
    assert (Embedder(path).embed(TEXTS) - direct).abs().max() < 1e-6


def test_token_ids_give_the_texts_vectors(tiny_bert):
    embedder = Embedder(tiny_bert)
    plain = [embedder.tokenizer(t.strip(), add_special_tokens=False)["input_ids"] for t in TEXTS]
    ids = [embedder.with_special_tokens(row) for row in plain]
    assert (embedder.embed_ids(ids) - embedder.embed(TEXTS)).abs().max() < 1e-6


def test_too_long_input_is_refused_or_truncated(tmp_path):
    path = make_tiny_bert(tmp_path / "short", max_seq_length=8)
    embedder = Embedder(path)
    long_text = TEXTS[3]
    with pytest.raises(TesselError, match="at most 8"):
        embedder.embed([long_text])
    truncated = embedder.embed([long_text], truncate=True)
    _close(truncated, oracle_embeddings(path, [long_text], max_length=8))


def test_dimensions_need_matryoshka(tiny_bert):
    embedder = Embedder(tiny_bert)
    with pytest.raises(TesselError, match="Matryoshka"):
        embedder.embed(TEXTS, dimensions=16)
    assert embedder.embed(TEXTS, dimensions=32).shape == (len(TEXTS), 32)
    short = Embedder(tiny_bert, matryoshka=True).embed(TEXTS, dimensions=16)
    full = embedder.embed(TEXTS)
    expected = torch.nn.functional.normalize(full[:, :16], dim=1)
    assert (short - expected).abs().max() < 1e-6
    with pytest.raises(TesselError, match=r"\[1, 32\]"):
        Embedder(tiny_bert, matryoshka=True).embed(TEXTS, dimensions=33)


def test_decoder_reader_refuses_an_encoder_and_back(tiny_bert, checkpoints):
    with pytest.raises(TesselError, match="encoder .*tessel embed"):
        read_model(tiny_bert)
    with pytest.raises(TesselError, match="not an encoder"):
        read_encoder(checkpoints("llama"))


def test_wrong_shape_and_unknown_tensor_are_named(tmp_path):
    path = make_tiny_bert(tmp_path / "bad")
    weights = load_file(path / "model.safetensors")
    weights["encoder.layer.1.intermediate.dense.weight"] = torch.zeros(65, 32)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(TesselError, match="intermediate.dense.weight.*intermediate_size"):
        read_encoder(path)
    weights["encoder.layer.1.intermediate.dense.weight"] = torch.zeros(64, 32)
    weights["encoder.layer.9.extra"] = torch.zeros(1)
    save_file(weights, path / "model.safetensors")
    with pytest.raises(TesselError, match="unexpected tensor 'encoder.layer.9.extra'"):
        read_encoder(path)


def test_unsupported_module_and_config_are_named(tmp_path):
    path = make_tiny_bert(tmp_path / "dense")
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(TesselError, match="module 'Dense' is not supported"):
        Embedder(path)
    other = make_tiny_bert(tmp_path / "relu", position_embedding_type="relative_key")
    with pytest.raises(TesselError, match="position_embedding_type 'relative_key'"):
        read_encoder(other)
