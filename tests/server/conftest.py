"""Fixtures for the server tests: a tiny random checkpoint, built locally once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("server") / "tiny-llama", arch="llama")
