"""Latency SLOs on a simulated run, and goodput: the highest arrival rate whose run meets them.

An SLO is a p90 TTFT and a p90 TPOT (seconds), from a workload file's `slo:` or the command line.
`check_slo` holds a run's percentiles against it. `find_goodput` searches the arrival rate: a
rate above what the plan serves queues requests for the whole run (TTFT grows with the run's
length), so the search runs from `capacity_req_s` (the plan's throughput over its mean output
tokens) down: it checks the capacity, then a floor far below it (`FLOOR_SHARE`), and bisects
between a rate that meets the SLOs and one that misses them for `STEPS` simulations. A fixed count
of simulations, each of a fixed count of requests: the search always ends. When even the floor
misses, the SLOs are unreachable for this plan and the error says what the plan reaches there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tessel.errors import TesselError
from tessel.sim.sim_metrics import Metrics

STEPS = 6  # bisection simulations after the capacity and the floor
FLOOR_SHARE = 1 / 64  # the lowest rate tried, as a share of the capacity


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_p90_s: float
    tpot_p90_s: float

    def __post_init__(self) -> None:
        for name, value in (("p90 TTFT", self.ttft_p90_s), ("p90 TPOT", self.tpot_p90_s)):
            if not (math.isfinite(value) and value > 0):
                raise TesselError(f"the {name} SLO must be a finite number of seconds > 0, got {value}")

    def text(self) -> str:
        return f"p90 TTFT <= {self.ttft_p90_s:g} s, p90 TPOT <= {self.tpot_p90_s * 1e3:g} ms"


@dataclass(frozen=True, slots=True)
class SloCheck:
    rate_req_s: float | None  # the arrival rate simulated (None: the workload's own)
    ttft_p90_s: float
    tpot_p90_s: float
    met: bool

    def text(self, slo: Slo) -> str:
        """The verdict, then each SLO's (a run without a TPOT sample meets TPOT)."""
        verdict = "met" if self.met else "missed"
        at = "" if self.rate_req_s is None else f" at {self.rate_req_s:.4g} req/s"
        ttft = "met" if self.ttft_p90_s <= slo.ttft_p90_s else "missed"
        tpot = "missed" if self.tpot_p90_s > slo.tpot_p90_s else "met"
        return (
            f"SLO {verdict}{at}: p90 TTFT {self.ttft_p90_s:.3f} s (SLO {slo.ttft_p90_s:g} s: {ttft}), "
            f"p90 TPOT {self.tpot_p90_s * 1e3:.2f} ms (SLO {slo.tpot_p90_s * 1e3:g} ms: {tpot})"
        )

    def to_json(self) -> dict:
        return {"rate_req_s": self.rate_req_s, "ttft_p90_s": self.ttft_p90_s,
                "tpot_p90_s": self.tpot_p90_s, "met": self.met}  # fmt: skip


def check_slo(metrics: Metrics, slo: Slo, rate_req_s: float | None = None) -> SloCheck:
    """A run against the SLO (a run without a TPOT sample, one output token each, meets TPOT)."""
    ttft, tpot = metrics.ttft_s.p90, metrics.tpot_s.p90
    tpot_ok = math.isnan(tpot) or tpot <= slo.tpot_p90_s
    return SloCheck(rate_req_s, ttft, tpot, bool(ttft <= slo.ttft_p90_s and tpot_ok))


@dataclass(frozen=True, slots=True)
class Goodput:
    rate_req_s: float  # the highest rate tried that met the SLOs
    capacity_req_s: float
    checks: tuple[SloCheck, ...]  # every simulation, in the order run

    def to_json(self) -> dict:
        return {
            "goodput_req_s": self.rate_req_s,
            "capacity_req_s": self.capacity_req_s,
            "checks": [c.to_json() for c in self.checks],
        }


def find_goodput(
    run_at: Callable[[float], Metrics], capacity_req_s: float, slo: Slo, steps: int = STEPS
) -> Goodput:
    """The highest arrival rate in [capacity x FLOOR_SHARE, capacity] at which `run_at(rate)`'s
    percentiles meet the SLO (module docstring); TesselError when the floor misses them."""
    if not (math.isfinite(capacity_req_s) and capacity_req_s > 0):
        raise TesselError(f"the plan serves no requests (capacity {capacity_req_s} req/s): no goodput")
    checks = []

    def tried(rate: float) -> SloCheck:
        checks.append(check_slo(run_at(rate), slo, rate))
        return checks[-1]

    if tried(capacity_req_s).met:
        return Goodput(capacity_req_s, capacity_req_s, tuple(checks))
    floor = capacity_req_s * FLOOR_SHARE
    low = tried(floor)
    if not low.met:
        raise TesselError(
            f"the SLOs ({slo.text()}) are out of this plan's reach: at {floor:.4g} req/s "
            f"({FLOOR_SHARE:.2%} of the {capacity_req_s:.4g} req/s it serves) its p90 TTFT is "
            f"{low.ttft_p90_s:.3f} s and its p90 TPOT {low.tpot_p90_s * 1e3:.2f} ms; relax them, or plan "
            "for a smaller --mip-gap, fewer micro-batches in flight or more GPUs"
        )
    good, bad = floor, capacity_req_s
    for _ in range(steps):
        middle = math.sqrt(good * bad)  # rates span orders of magnitude: bisect geometrically
        if tried(middle).met:
            good = middle
        else:
            bad = middle
    return Goodput(good, capacity_req_s, tuple(checks))


CONFIRM_FLOOR_SHARE = 0.5  # `confirm_rate` searches no lower than this share of the planned rate
CONFIRM_STEPS = 4  # bisections below a planned rate that misses: within 2^(1/16) = 4.4% of the highest


def confirm_rate(
    run_at: Callable[[float], Metrics], planned_req_s: float, slo: Slo, steps: int = CONFIRM_STEPS
) -> Goodput:
    """The planner's rate held against the simulator: one run when it meets the SLO; else the highest
    rate in [CONFIRM_FLOOR_SHARE x planned, planned] that does (geometric bisection, `steps` runs),
    or, when even the floor misses, a Goodput of rate 0 whose checks say what the runs reached."""
    checks = [check_slo(run_at(planned_req_s), slo, planned_req_s)]
    if checks[0].met:
        return Goodput(planned_req_s, planned_req_s, tuple(checks))
    floor = planned_req_s * CONFIRM_FLOOR_SHARE
    checks.append(check_slo(run_at(floor), slo, floor))
    if not checks[-1].met:
        return Goodput(0.0, planned_req_s, tuple(checks))
    good, bad = floor, planned_req_s
    for _ in range(steps):
        middle = math.sqrt(good * bad)
        checks.append(check_slo(run_at(middle), slo, middle))
        good, bad = (middle, bad) if checks[-1].met else (good, middle)
    return Goodput(good, planned_req_s, tuple(checks))
