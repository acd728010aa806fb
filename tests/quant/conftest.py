"""Quantisation fixtures: a tiny random Llama checkpoint and its calibration text, torch on one thread."""

from __future__ import annotations

from pathlib import Path

import pytest

import tiny_models
from engine_fixtures import _one_thread, checkpoints  # noqa: F401


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hidden 64, FFN 128, 2 layers, GQA 4/2 heads: group 128 does not divide it, group 32 does."""
    return tiny_models.make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=3)


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text((tiny_models.CORPUS + "\n") * 6, encoding="utf-8")
    return path
