"""Decode points timed as the engine runs them on a GPU: captured once as a CUDA graph, replayed.

The engine replays its pure decode steps as CUDA graphs (`tessel.engine.cuda_graph`), so a decode
step costs the GPU's time alone; timed eagerly, a small layer's decode costs the host's kernel
launches instead (the GPU waits on Python). A profile that prices the graph-replayed engine times
its decode points the same way. Prefill stays eager, as in the engine.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable


def graph_replay(step: Callable[[], object]) -> Callable[[], object] | None:
    """`step` captured as a CUDA graph (after one eager run: Triton compiles and the autotuner picks
    its tiles outside the capture) -> its replay; None, with a warning, where the capture fails
    (the caller then times `step` eagerly)."""
    import torch

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception as error:  # noqa: BLE001 (any capture failure: the point is timed eagerly)
        warnings.warn(
            f"capturing a decode point as a CUDA graph failed ({type(error).__name__}: {error}); "
            "timing it eagerly",
            RuntimeWarning,
            stacklevel=2,
        )
        torch.cuda.synchronize()
        return None
    return graph.replay


def decode_step(forward: Callable[[], object], cuda_graphs: bool) -> Callable[[], object]:
    """What a decode point times: `forward` itself, or its graph's replay when `cuda_graphs`."""
    if not cuda_graphs:
        return forward
    return graph_replay(forward) or forward
