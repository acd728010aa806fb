"""Fixtures shared by tests/engine and tests/models (their conftests import them)."""

from __future__ import annotations

from pathlib import Path

import pytest

import tiny_models


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """checkpoints(name) -> path of the tiny_models.VARIANTS checkpoint `name` (built once)."""
    root = tmp_path_factory.mktemp("checkpoints")

    def get(name: str) -> Path:
        return tiny_models.variant_checkpoint(root, name)

    return get


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run faster on one thread, and much faster on a loaded machine; restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
