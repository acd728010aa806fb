"""Fixtures shared by the kernel tests.

- `poison_outputs` (autouse): every buffer a host function gets from `tessel.kernels._utils.
  empty_output` starts full of a value no kernel writes there (`poison_value`), so an output
  element a kernel forgets to write fails the comparison with the reference. It returns the list
  of buffers handed out, which `test_output_seam.py` uses to check that every op allocates there.
- `backend`: runs a test once on the Triton kernel (interpreter) and once on the PyTorch path.

Seeds (`_seed`, autouse) and the `triton_backend` / `torch_backend` fixtures come from
tests/conftest.py, which also sets TRITON_INTERPRET=1 before any kernel is imported.
"""

from __future__ import annotations

import pytest
import torch

from tessel.kernels import _utils


def poison_value(dtype: torch.dtype) -> float | int | bool:
    """NaN for floats; True for bool; for integers the end of the range no kernel reaches (int8
    quantisation clamps to [-127, 127], test inputs stay far inside the range)."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        return True
    info = torch.iinfo(dtype)
    return info.min if info.min < 0 else info.max


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    handed_out: list[torch.Tensor] = []

    def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = torch.full(shape, poison_value(dtype), dtype=dtype, device=device)
        handed_out.append(buffer)
        return buffer

    monkeypatch.setattr(_utils, "empty_output", poisoned)
    return handed_out


@pytest.fixture(params=["triton_backend", "torch_backend"])
def backend(request: pytest.FixtureRequest) -> str:
    request.getfixturevalue(request.param)
    return request.param
