"""What the last stage hands back to stage 0 for one micro-batch: the sampled tokens and, where the
requests asked, their logprobs and the prompt logprobs of the micro-batch's chunks.

The last stage computes them with the single-process engine's own functions
(`tessel.engine.model_runner.sampled_logprobs`, `score_prompt`); stage 0 applies them with the
engine's own update (`LLMEngine._finish_step`), so a pipeline's `RequestOutput`s carry the same
logprobs as one process's.

On the wire: int64 `[micro-batch id, payload bytes, tokens...]`, then, only when payload bytes > 0
(some request asked for logprobs), the pickled (logprobs, prompt logprobs) as uint8. Stage 0 knows
how many tokens to expect: it chose the rows that are sampled.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import torch

from tessel.engine.outputs import TokenLogprobs

HEAD_LEN = 2  # micro-batch id, payload bytes


@dataclass(slots=True)
class SampledRows:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per token; None: not asked
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)  # per prompt scoring

    def __post_init__(self) -> None:
        if not self.logprobs:
            self.logprobs = [None] * len(self.tokens)

    @property
    def has_logprobs(self) -> bool:
        return bool(self.prompt_logprobs) or any(entry is not None for entry in self.logprobs)

    def to_wire(self, batch_id: int) -> tuple[torch.Tensor, ...]:
        """The tensors to send: the head with the tokens, then the logprobs payload if any."""
        payload = pickle.dumps((self.logprobs, self.prompt_logprobs)) if self.has_logprobs else b""
        head = torch.tensor([batch_id, len(payload), *self.tokens], dtype=torch.int64)
        if not payload:
            return (head,)
        return head, torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    @classmethod
    def from_wire(cls, tokens: list[int], payload: bytes) -> SampledRows:
        if not payload:
            return cls(tokens)
        logprobs, prompt_logprobs = pickle.loads(payload)
        if len(logprobs) != len(tokens):
            raise ValueError(f"{len(logprobs)} logprob entries for {len(tokens)} tokens")
        return cls(tokens, logprobs, prompt_logprobs)
