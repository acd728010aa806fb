"""Requests dealt to weighted targets (replicas, a flow plan's paths) in turn, without randomness.

Tijdeman's chairman assignment (R. Tijdeman, "The chairman assignment problem", Discrete Math. 32,
1980): with m >= 2 targets of shares s_r (weights over their sum) and c_r requests dealt to r so
far, request n goes to the target that is owed at least 1/(2m - 2) (n s_r - c_r >= 1/(2m - 2)) and
whose deadline (c_r + 1 - 1/(2m - 2)) / s_r comes first; ties go to the lower index. After any n
requests every target then holds within 1 - 1/(2m - 2) of n s_r of them (under one), the best
bound that holds for all shares. Smooth weighted round-robin (the largest n s_r - c_r) can miss by
more than one (shares 5 : 6.89 : 6.89 : 0.31 : 0.31 at n = 279).

The simulator's replica routing (`tessel.sim.routing`), the planner's batch throughput of a flow
plan (`tessel.plan.flow.flow.routed_counts`) and the runtime's path assignment
(`tessel.pipeline.flow`) all deal by this one rule, so they agree request for request.
"""

from __future__ import annotations

from collections.abc import Sequence

_EPS = 1e-12  # float slack in the eligibility test (shares are sums of floats)


class WeightedTurns:
    """Deals targets in turn by `weights` (positive); `next()` -> the next request's target.
    `dealt`: what each target already holds (default none), counted as dealt before."""

    def __init__(self, weights: Sequence[float], dealt: Sequence[int] | None = None) -> None:
        if not weights or min(weights) <= 0:
            raise ValueError("weights must be positive")
        total = float(sum(weights))
        self.shares = [w / total for w in weights]
        self.counts = list(dealt) if dealt is not None else [0] * len(weights)
        self.dealt = sum(self.counts)
        m = len(weights)
        self._margin = 1.0 / (2 * m - 2) if m > 1 else 0.0

    def next(self) -> int:
        self.dealt += 1
        n, margin = self.dealt, self._margin
        owed = [n * s - c for s, c in zip(self.shares, self.counts, strict=True)]
        eligible = [r for r, o in enumerate(owed) if o >= margin - _EPS]
        target = min(eligible, key=lambda r: ((self.counts[r] + 1.0 - margin) / self.shares[r], r))
        self.counts[target] += 1
        return target


def dealt_counts(weights: Sequence[float], n_requests: int) -> list[int]:
    """How many of the first `n_requests` each target is dealt."""
    turns = WeightedTurns(weights)
    for _ in range(n_requests):
        turns.next()
    return turns.counts
