"""Routing a trace across replicas: every request once, each replica its dealt share in order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessel.plan.replicas.weighted_turns import dealt_counts
from tessel.sim.requests import Request
from tessel.sim.routing import route


@settings(max_examples=50, deadline=None)
@given(
    weights=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=6),
    n=st.integers(0, 300),
)
def test_every_prefix_of_the_trace_is_dealt_by_the_weights(weights: list[float], n: int) -> None:
    requests = [Request(i, 0.5 * i, 10, 5) for i in range(n)]
    routed = route(list(reversed(requests)), weights)  # in arrival order, whatever the list's
    assert sorted(r.id for share in routed for r in share) == list(range(n))
    for k in (n // 3, n):  # a prefix of the trace too
        assert [sum(1 for r in share if r.id < k) for share in routed] == dealt_counts(weights, k)


def test_bad_weights_are_refused() -> None:
    with pytest.raises(ValueError):
        route([Request(0, 0.0, 1, 1)], [1.0, 0.0])
