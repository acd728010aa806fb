"""Stage latencies with closed forms, vectorised over chunks.

`PolynomialStage` is a stage whose per-layer prefill time has the profile's form
`a0 + a1*c + a2*p + a3*c*(p + c/2)` (tessel.cost.profile.PrefillFit), times a number of layers,
plus a fixed per-chunk extra (embedding lookup on the first stage). Its link to the next stage costs
`latency + c * bytes_per_token / bandwidth`. It is what a `tessel profile` measurement gives for
a stage, and the hand-made stages the tests and benchmarks use.

Besides the scalar `StageLatency` methods, stages here answer whole arrays at once
(`prefill_times_s`, `send_times_s`); the chunk planner uses those when present to build its tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessel.cost.profile import DecodeFit, PrefillFit


@dataclass(frozen=True, slots=True)
class PolynomialStage:
    prefill: PrefillFit  # seconds per layer
    layers: float = 1.0
    decode: DecodeFit | None = None  # seconds per layer
    chunk_extra_s: float = 0.0  # per chunk on top of the layers (e.g. embedding lookup)
    send_latency_s: float = 0.0  # 0 and 0: the last stage (sends nothing)
    send_s_per_token: float = 0.0  # hidden bytes per token / link bandwidth

    def prefill_times_s(self, chunk_tokens: np.ndarray, offset_tokens: np.ndarray) -> np.ndarray:
        c = np.asarray(chunk_tokens, dtype=np.float64)
        p = np.asarray(offset_tokens, dtype=np.float64)
        fit = self.prefill
        return (
            self.layers * (fit.a0 + fit.a1 * c + fit.a2 * p + fit.a3 * c * (p + c / 2)) + self.chunk_extra_s
        )

    def send_times_s(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.float64)
        if self.send_latency_s == 0.0 and self.send_s_per_token == 0.0:
            return np.zeros_like(tokens)
        return self.send_latency_s + self.send_s_per_token * tokens

    def prefill_signature(self) -> tuple:
        return (self.prefill, self.layers, self.chunk_extra_s)

    def send_signature(self) -> tuple:
        return (self.send_latency_s, self.send_s_per_token)

    def prefill_time_s(self, chunk_tokens: int, offset_tokens: int) -> float:
        return float(self.prefill_times_s(np.asarray(chunk_tokens), np.asarray(offset_tokens)))

    def decode_time_s(self, batch_size: int, sum_context_tokens: int) -> float:
        if self.decode is None:
            raise ValueError("this stage has no decode fit")
        return self.layers * self.decode.time_s(batch_size, sum_context_tokens)

    def send_time_s(self, tokens: int) -> float:
        return float(self.send_times_s(np.asarray(tokens)))
