"""Pipeline-runtime fixtures: tiny checkpoints and hand-written plan files."""

from __future__ import annotations

from pathlib import Path

import pytest

import tiny_models
from engine_fixtures import _one_thread  # noqa: F401
from pipeline_plans import write_plan  # noqa: F401


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`tied`: 5-layer Llama, tied embeddings, GQA; `untied`: 6-layer Llama, own LM head, 2 shards."""
    root = tmp_path_factory.mktemp("pipeline-models")
    return {
        "tied": tiny_models.make_tiny_checkpoint(
            root / "tied", tie_word_embeddings=True, num_hidden_layers=5, seed=1
        ),
        "untied": tiny_models.make_tiny_checkpoint(root / "untied", num_hidden_layers=6, shards=2, seed=2),
    }
