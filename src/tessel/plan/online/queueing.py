"""Waiting for a seat: the M/G/c queue in front of a pipeline's c = k x b request slots.

Requests arrive as a Poisson stream at rate lambda and each holds one of c seats for a time S
(its whole stay: first token, then its decode steps). Erlang's C formula gives the chance an
arrival finds every seat taken, P_wait = C(c, a) with a = lambda E[S] (computed through the
Erlang B recursion B(n) = a B(n-1) / (n + a B(n-1)), stable for any c). Given that it waits, the
wait is close to exponential with rate (c - a) / E[S] for exponential stays; Allen and Cunneen's
correction divides the rate by (1 + cs2) / 2 for stays of squared coefficient of variation cs2.
So P(W > t) = P_wait exp(-theta t) and the p-quantile of the wait is 0 when P_wait <= 1 - p,
else ln(P_wait / (1 - p)) / theta.
"""

from __future__ import annotations

import math


def erlang_c(servers: int, offered: float) -> float:
    """Chance an arrival waits in an M/M/c queue with `offered` = lambda E[S] < servers (1 if not)."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    blocked = 1.0
    for n in range(1, servers + 1):
        blocked = offered * blocked / (n + offered * blocked)
    load = offered / servers
    return blocked / (1 - load * (1 - blocked))


def wait_quantile_s(
    servers: int, rate_per_s: float, stay_s: float, stay_cs2: float, quantile: float
) -> float:
    """The `quantile` of the wait for a seat (s): inf when the seats cannot keep up."""
    offered = rate_per_s * stay_s
    if offered >= servers:
        return math.inf
    waits = erlang_c(servers, offered)
    if waits <= 1 - quantile:
        return 0.0
    theta = (servers - offered) / stay_s * 2 / (1 + stay_cs2)
    return math.log(waits / (1 - quantile)) / theta
