"""The encoder on a CUDA GPU (float32, bfloat16) against HF transformers on the CPU; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from encoder_models import kjv_sentences, make_tiny_bert, minilm_dir, oracle_embeddings
from tessel.models.embedder import Embedder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_tiny_bert_on_cuda_matches_transformers(tmp_path):
    path = make_tiny_bert(tmp_path / "m")
    texts = ["The quick brown fox.", "Hello world!", "the cat sat on the mat and the dog sat on the log"]
    ours = Embedder(path, device="cuda").embed(texts)
    assert (ours - oracle_embeddings(path, texts)).abs().max() < 1e-4


def test_minilm_on_cuda_in_bfloat16_keeps_the_direction():
    path = minilm_dir()
    sentences = kjv_sentences(100)
    ours = Embedder(path, device="cuda", dtype="bfloat16").embed(sentences)
    cosine = torch.nn.functional.cosine_similarity(ours, oracle_embeddings(path, sentences))
    assert cosine.min() >= 0.999
