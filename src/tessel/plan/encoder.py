"""Planning an encoder (BERT): one forward per request, priced as a prefill with no decode.

An encoder reads at most `max_position_embeddings` tokens (sentence-transformers truncates longer
inputs), so a workload's prompt lengths are capped there (`encoder_workload`: mean, p99 and max
each capped, an upper bound on the mean of the truncated lengths). Its output lengths do not
matter: the objective is the prefill makespan of the m micro-batches in flight, and the planner
holds no KV cache for it. What a plan predicts (`encoder_prediction`): sequences per second
through the pipeline (m micro-batches of b sequences in the prefill makespan), the tokens per
second they carry, and the latency of one micro-batch through every stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.catalog.models import ModelSpec
from tessel.plan.files.workload import Workload


def encoder_workload(workload: Workload, model: ModelSpec) -> Workload:
    """`workload` with prompt lengths capped at what `model` reads; unchanged for a decoder."""
    cap = model.max_position_embeddings
    prompt = workload.prompt_tokens
    if not model.encoder or prompt.max_tokens <= cap:
        return workload
    if prompt.samples is not None:
        capped = prompt.model_copy(update={"samples": [min(s, cap) for s in prompt.samples]})
    else:
        update = {"mean": min(prompt.mean, cap), "max": min(prompt.max_tokens, cap)}
        update["p99"] = None if prompt.p99 is None else min(prompt.p99, cap)
        capped = prompt.model_copy(update=update)
    return workload.model_copy(update={"prompt_tokens": capped})


@dataclass(frozen=True, slots=True)
class EncoderPrediction:
    sequences_per_s: float  # embeddings per second through the pipeline
    tokens_per_s: float  # the input tokens those sequences carry
    batch_latency_s: float  # one micro-batch through every stage (and the links between them)
    mean_tokens: float  # tokens per sequence priced (capped at the model's positions)
    truncated: bool  # whether the workload's prompts were longer than the model reads


def encoder_prediction(
    model: ModelSpec, workload: Workload, micro_batches: int, prefill_makespan_s: float, stage_sum_s: float
) -> EncoderPrediction:
    """Throughput of m micro-batches of b sequences in `prefill_makespan_s` (sum + (m-1) max of the
    stages' prefill times); `stage_sum_s`: one micro-batch's pass through all stages."""
    capped = encoder_workload(workload, model)
    sequences = micro_batches * workload.micro_batch_size
    per_s = sequences / prefill_makespan_s if prefill_makespan_s > 0 else 0.0
    mean = capped.prompt_tokens.mean_tokens
    return EncoderPrediction(per_s, per_s * mean, stage_sum_s, mean, capped is not workload)
