"""What the last stage hands back to stage 0 for one micro-batch, on the wire: the sampled tokens
and, where the requests asked, their logprobs and the prompt logprobs of the micro-batch's chunks
(`tessel.engine.model_runner.SampledRows`).

The last stage samples them with the single-process engine's own `ModelRunner.sample_hidden`;
stage 0 applies them with the engine's own update (`LLMEngine._finish_step`), so a pipeline's
`RequestOutput`s carry the same logprobs as one process's.

On the wire: int64 `[micro-batch id, payload bytes, tokens...]`, then, only when payload bytes > 0
(some request asked for logprobs), the pickled (logprobs, prompt logprobs) as uint8. Stage 0 knows
how many tokens to expect: it chose the rows that are sampled.
"""

from __future__ import annotations

import pickle

import torch

from tessel.engine.model_runner import SampledRows

HEAD_LEN = 2  # micro-batch id, payload bytes


def to_wire(sampled: SampledRows, batch_id: int) -> tuple[torch.Tensor, ...]:
    """The tensors to send: the head with the tokens, then the logprobs payload if any."""
    payload = pickle.dumps((sampled.logprobs, sampled.prompt_logprobs)) if sampled.has_logprobs else b""
    head = torch.tensor([batch_id, len(payload), *sampled.tokens], dtype=torch.int64)
    if not payload:
        return (head,)
    return head, torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def from_wire(tokens: list[int], payload: bytes) -> SampledRows:
    if not payload:
        return SampledRows(tokens)
    logprobs, prompt_logprobs = pickle.loads(payload)
    if len(logprobs) != len(tokens):
        raise ValueError(f"{len(logprobs)} logprob entries for {len(tokens)} tokens")
    return SampledRows(tokens, logprobs, prompt_logprobs)
