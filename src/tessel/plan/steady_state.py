"""A pipeline's throughput in steady state under continuous batching, beside the objective's figure.

The k micro-batches keep circulating, and each round (one pass of every micro-batch) takes

    R = max(sum_j T_j, k max_j T_j)     per pass kind (prefill, decode)

(a micro-batch's next pass waits for its own previous one through every stage; the bottleneck
serves k passes a round), so the pipeline fill sum_j T_j - max_j T_j is not paid every round once
k >= S. steady state = k * b * n_out / (R^pre + n_out * R^dec). Its own module: the plan report and
the flow search (`tessel.plan.flow.flow`) both price with it, and neither imports the other.
"""

from __future__ import annotations

from collections.abc import Sequence


def steady_state_tok_s(
    prefill_s: Sequence[float],
    decode_s: Sequence[float],
    micro_batches: int,
    micro_batch_size: int,
    output_tokens: float,
    shares: Sequence[float] | None = None,
) -> float:
    """Generated tokens/s of a pipeline in steady state under continuous batching (the module
    docstring): k micro-batches of b requests circulate through stages of times T_j (per pass kind),
    a round takes max(sum_j T_j, k max_j T_j / phi_j) and a request lives one prefill round and
    n_out decode rounds. `shares` phi_j: the share of each device's time the pipeline gets (a flow
    path on shared devices; default all 1). Every plan kind's figure comes from here."""
    k = micro_batches
    if k <= 0 or len(prefill_s) == 0:
        return 0.0
    phi = [1.0] * len(prefill_s) if shares is None else list(shares)
    rounds = []
    for times in (prefill_s, decode_s):
        times = [float(t) for t in times]
        bottleneck = max(t / s for t, s in zip(times, phi, strict=True))
        rounds.append(max(sum(times), k * bottleneck))
    total = rounds[0] + output_tokens * rounds[1]
    return k * micro_batch_size * output_tokens / total if total > 0 else 0.0
