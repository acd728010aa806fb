"""Which layers of a stage stream their weights from host memory (the plan's `offload_layers`).

The planner decides how many bytes a stage holds beyond its device memory (`offload_bytes`,
`tessel.plan.solution`); the runtime can free device memory only by keeping whole decoder layers'
weights in host memory and copying each in before it runs (`tessel.engine.weight_stream`). The
device then still holds `STREAM_BUFFERS` layers' worth of buffers: the layer running and the copy of
the next one (double buffering, as FlexGen and accelerate do). So streaming the last n layers of a
stage frees

    freed(n) = sum of their weight bytes - the bytes of the largest min(n, STREAM_BUFFERS) of them

and a stage streams the fewest last layers whose `freed(n)` covers its offloaded bytes (all of its
layers when none does: the rest is KV or activations, which do not stream). The streamed layers are
the stage's last ones, so the first copy overlaps the compute of the resident layers before it.

Every pass copies each streamed layer in whole, so a stage's swap-in per pass is `copied_bytes`: the
weight bytes of its streamed layers (about the offloaded bytes plus STREAM_BUFFERS layers), not just
the offloaded bytes. What even streaming every layer cannot free is priced per byte on top, so the
cost keeps growing with the overflow (the runtime cannot hold such a stage: `check_offload` refuses
it). The planner prices this with `PlanningInstance.stream_layers` (`tessel.plan.solution`).
"""

from __future__ import annotations

from collections.abc import Sequence

STREAM_BUFFERS = 2  # device buffers of a streaming stage: the layer running and the next one's copy


def freed_bytes(streamed_layer_bytes: Sequence[float]) -> float:
    """Device bytes freed by streaming layers of these weight bytes (their buffers stay on the device)."""
    buffers = sorted(streamed_layer_bytes, reverse=True)[:STREAM_BUFFERS]
    return float(sum(streamed_layer_bytes) - sum(buffers))


def streamed_count(layer_bytes: Sequence[float], offload_bytes: float) -> int:
    """How many of a stage's last layers stream (`layer_bytes`: weight bytes of each of its layers,
    in order) so that the device holds `offload_bytes` less; 0 when nothing is offloaded."""
    if offload_bytes <= 0:
        return 0
    for n in range(1, len(layer_bytes) + 1):
        if freed_bytes(layer_bytes[len(layer_bytes) - n :]) >= offload_bytes:
            return n
    return len(layer_bytes)


def offload_layers(layer_start: int, layer_bytes: Sequence[float], offload_bytes: float) -> list[int]:
    """The decoder layers (absolute indices) of a stage starting at `layer_start` whose weights
    stream from host memory."""
    n = streamed_count(layer_bytes, offload_bytes)
    layer_end = layer_start + len(layer_bytes)
    return list(range(layer_end - n, layer_end))


def copied_bytes(layer_bytes: Sequence[float], offload_bytes: float) -> float:
    """Bytes a stage copies in per pass to hold `offload_bytes` less: the weight bytes of the layers
    `streamed_count` picks, plus whatever streaming all of them does not free."""
    if offload_bytes <= 0:
        return 0.0
    n = streamed_count(layer_bytes, offload_bytes)
    streamed = layer_bytes[len(layer_bytes) - n :]
    return float(sum(streamed)) + max(offload_bytes - freed_bytes(streamed), 0.0)
