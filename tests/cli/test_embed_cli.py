"""`tessel embed`: the vectors it writes equal HF transformers + the model's pooling; user errors exit 2."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import user_error
from hypothesis import given, settings
from typer.testing import CliRunner

from bad_text import lone_surrogate_texts
from encoder_models import make_tiny_bert, oracle_embeddings
from tessel.cli import app

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world!"]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("enc") / "tiny-bert", max_seq_length=12)


def test_embed_writes_the_oracle_vectors(encoder_dir, tmp_path):
    out = tmp_path / "vectors.json"
    args = ["embed", "--model", encoder_dir, "--json", out, "--threads", "1"]
    result = CliRunner().invoke(app, [str(a) for a in args] + [x for t in TEXTS for x in ("--text", t)])
    assert result.exit_code == 0, result.output
    assert "cosine similarities" in result.output and "[1] " in result.output
    document = json.loads(out.read_text())
    vectors = torch.tensor([item["embedding"] for item in document["data"]])
    assert document["dimensions"] == 32 and document["normalized"] is True
    assert (vectors - oracle_embeddings(encoder_dir, TEXTS)).abs().max() < 1e-5


def test_embed_user_errors(encoder_dir, tmp_path):
    from tiny_models import make_tiny_checkpoint

    decoder = make_tiny_checkpoint(tmp_path / "llama", arch="llama")
    long_text = "the cat sat on the mat " * 5
    assert "at most 12" in user_error(["embed", "--model", encoder_dir, "--text", long_text])
    args = ["embed", "--model", str(encoder_dir), "--text", long_text, "--truncate"]
    truncated = CliRunner().invoke(app, args)
    assert truncated.exit_code == 0 and "12 tokens" in truncated.output
    assert "Matryoshka" in user_error(["embed", "--model", encoder_dir, "--text", "hi", "--dimensions", "8"])
    assert "not an encoder" in user_error(["embed", "--model", decoder, "--text", "hi"])
    to_folder = ["embed", "--model", encoder_dir, "--text", "hi", "--json", tmp_path]
    assert "is a directory" in user_error(to_folder)
    assert "tessel embed" in user_error(["generate", "--model", encoder_dir, "--prompt", "hi"])


@settings(max_examples=10, deadline=None)
@given(bad=lone_surrogate_texts())
def test_embed_refuses_a_text_that_is_not_valid_unicode(encoder_dir, bad):
    """A command line's bytes that are not UTF-8 reach Python as lone surrogates (issue 42)."""
    text, refusal = bad
    message = user_error(["embed", "--model", encoder_dir, "--text", "hello", "--text", text])
    assert f"--text 2 is not valid Unicode: a {refusal}" in message
