"""How to sample one request (vLLM's field names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from tessel.errors import TesselError


@dataclass(slots=True)
class SamplingParams:
    """temperature 0 is greedy; top_k <= 0 and top_p = 1 switch those filters off.

    `max_tokens=None` generates until EOS/stop or `max_model_len`. `stop` strings end the request
    and are cut from the text; `stop_token_ids` (and EOS, unless `ignore_eos`) end it and stay in
    `token_ids`. `seed` gives the request its own generator: same seed, same tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise TesselError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise TesselError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None:
            self.top_k = 0
        if self.top_k < -1:
            raise TesselError(f"top_k must be >= 0 (0 or -1: off), got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise TesselError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
