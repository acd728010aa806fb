"""The budget one command's phases share (`tessel.deadline`): each phase gets its weight's share of the
time left when it starts, what one leaves unspent goes to the later ones; and the order a loop stopped
at its deadline keeps points from the whole range in. A fake clock, moved by hand."""

from __future__ import annotations

import random

from tessel.deadline import Deadline, spread_order


class Hands:
    """A clock moved by hand."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_phases_share_the_time_left_when_they_start() -> None:
    rng = random.Random()
    for _ in range(100):
        clock, budget_s = Hands(), rng.uniform(1.0, 1000.0)
        weights = {name: rng.uniform(0.1, 5.0) for name in ("a", "b", "c")}
        phases = Deadline.after(budget_s, clock).phases(weights)
        a = phases.start("a")
        assert abs(a.left_s() - budget_s * weights["a"] / sum(weights.values())) < 1e-9 * budget_s
        clock.now_s += rng.uniform(0.0, 2.0) * a.left_s()  # it ends early, or overruns
        left_s = max(0.0, budget_s - clock.now_s)
        b = phases.start("b")
        assert abs(b.left_s() - left_s * weights["b"] / (weights["b"] + weights["c"])) < 1e-9 * budget_s
        clock.now_s = b.end_s
        assert b.passed()
        c = phases.start("c")  # the last: all that is left
        assert abs(c.end_s - max(clock.now_s, budget_s)) < 1e-9 * budget_s


def test_a_spread_order_visits_each_point_once_and_every_prefix_spans_the_range() -> None:
    for n in [0, 1, 2, 3, *random.sample(range(4, 500), 20)]:
        order = spread_order(n)
        assert sorted(order) == list(range(n))
        for k in range(2, n + 1):
            prefix = sorted(order[:k])
            assert prefix[0] == 0 and prefix[-1] == n - 1
            assert max(b - a for a, b in zip(prefix, prefix[1:], strict=False)) <= 2 * (n - 1) / (k - 1) + 1
