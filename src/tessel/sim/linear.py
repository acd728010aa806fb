"""A `StageLatency` given by a few coefficients: for tests, examples and what-if questions.

    prefill(c, p) = prefill_base_s + prefill_per_token_s * c + attention_s * c * (p + c/2)
    decode(B, S)  = decode_base_s + decode_per_seq_s * B + decode_per_context_s * S
    send(n)       = send_latency_s + send_per_token_s * n     (0 for n = 0)

the same shapes as the profile fits in `tessel.cost.profile`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LinearStage:
    prefill_base_s: float = 0.0
    prefill_per_token_s: float = 0.0
    attention_s: float = 0.0
    decode_base_s: float = 0.0
    decode_per_seq_s: float = 0.0
    decode_per_context_s: float = 0.0
    send_latency_s: float = 0.0
    send_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def prefill_time_s(self, chunk_tokens: int, offset_tokens: int) -> float:
        c, p = chunk_tokens, offset_tokens
        return self.prefill_base_s + self.prefill_per_token_s * c + self.attention_s * c * (p + c / 2)

    def decode_time_s(self, batch_size: int, sum_context_tokens: int) -> float:
        return (
            self.decode_base_s
            + self.decode_per_seq_s * batch_size
            + self.decode_per_context_s * sum_context_tokens
        )

    def send_time_s(self, tokens: int) -> float:
        return self.send_latency_s + self.send_per_token_s * tokens if tokens > 0 else 0.0
