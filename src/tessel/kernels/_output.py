"""Output buffers of the kernels' host functions, in one place.

Kernels write every element of their output, so the buffer starts uninitialised. Tests replace
`empty_output` with a buffer full of values no kernel produces (NaN, an out-of-range int), so an
element a kernel forgets to write fails the comparison; host functions therefore call it as
`_output.empty_output(...)`, looked up at call time.
"""

from __future__ import annotations

import torch


def empty_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)
