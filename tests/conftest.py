"""Test-wide setup.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before any test
module imports a kernel: Triton kernels then run on CPU tensors. Which path a call takes is still
chosen per call by TESSEL_KERNEL_BACKEND (the `triton_backend` / `torch_backend` fixtures).
"""

from __future__ import annotations

import os
import random

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    np.random.seed(0)
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(0)


@pytest.fixture
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TESSEL_KERNEL_BACKEND", "triton")


@pytest.fixture
def torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSEL_KERNEL_BACKEND", "torch")


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as an fp32 HF checkpoint, built once and cached outside the repo."""
    import real_model

    try:
        return real_model.smollm2_dir()
    except real_model.RealModelUnavailable as error:
        pytest.skip(f"SmolLM2 checkpoint unavailable: {error}")
