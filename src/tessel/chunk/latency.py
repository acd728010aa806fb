"""What the chunk planner and the simulator need to know about one pipeline stage.

A `StageLatency` answers, for the layers a plan puts on one device: how long a prefill chunk of
c tokens at offset p takes, how long a decode step of a batch takes, and how long sending the
hidden states of some tokens to the next stage takes (0 on the last stage). Implementations are
built from the cost model (analytic or profiled) for a plan's stages, or by hand in tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class StageLatency(Protocol):
    def prefill_time_s(self, chunk_tokens: int, offset_tokens: int) -> float: ...

    def decode_time_s(self, batch_size: int, sum_context_tokens: int) -> float: ...

    def send_time_s(self, tokens: int) -> float: ...


@dataclass(frozen=True, slots=True)
class PipelineLatency:
    """The stages of a plan in pipeline order."""

    stages: tuple[StageLatency, ...]

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a pipeline needs at least one stage")

    @property
    def n_stages(self) -> int:
        return len(self.stages)
