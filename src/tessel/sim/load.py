"""Is a simulated workload more than the plan can serve? Offered load against what the run served.

With Poisson arrivals, `offered` = (n - 1) / (last arrival - first arrival) requests/s (times the mean
output length for tok/s). A plan serving below its capacity finishes requests about as fast as
they come, so its throughput over the makespan is close to the offered rate. Over capacity the
queue grows for the whole run: throughput stays at the capacity and each request waits longer
than the one before. A run is called overloaded when both show: it served under
`SERVED_SHARE` of the offered tokens/s, and the mean TTFT of the last quarter of arrivals is over
`TTFT_GROWTH` times that of the first quarter. A closed batch (all at t = 0) has no offered rate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from tessel.sim.sim_metrics import Metrics
from tessel.sim.simulator import SimResult

SERVED_SHARE = 0.9  # finite runs drain after the last arrival: served a little under offered is normal
TTFT_GROWTH = 2.0  # queueing: late arrivals wait this much longer than early ones
MIN_REQUESTS = 8  # fewer give no quarters to compare


@dataclass(frozen=True, slots=True)
class LoadCheck:
    offered_req_s: float
    offered_tok_s: float
    served_req_s: float  # the simulation's throughput over its makespan: the capacity when overloaded
    served_tok_s: float
    ttft_first_quarter_s: float  # mean TTFT of the earliest quarter of arrivals
    ttft_last_quarter_s: float
    overloaded: bool
    planner_tok_s: float | None = None  # the plan's predicted throughput, where it gives one

    def to_json(self) -> dict:
        return asdict(self)

    def message(self) -> str:
        planner = "" if self.planner_tok_s is None else f"; the planner predicts {self.planner_tok_s:,.1f}"
        return (
            f"overloaded: offered load {self.offered_tok_s:,.1f} tok/s ({self.offered_req_s:,.3g} req/s) is "
            f"more than the plan serves, {self.served_tok_s:,.1f} tok/s ({self.served_req_s:,.3g} req/s)"
            f"{planner + ' tok/s' if planner else ''}. Requests queue for the whole run, so TTFT grows from "
            f"{self.ttft_first_quarter_s * 1e3:,.1f} ms (first quarter of arrivals) to "
            f"{self.ttft_last_quarter_s * 1e3:,.1f} ms (last quarter) and depends on the run's length; "
            f"give --rate below {self.served_req_s:,.3g} to see the plan's latency"
        )


def check_load(result: SimResult, metrics: Metrics, planner_tok_s: float | None = None) -> LoadCheck | None:
    """The offered load against what the run served; None for a closed batch or too few requests."""
    records = sorted(result.records, key=lambda r: (r.request.arrival_s, r.request.id))
    n = len(records)
    span = records[-1].request.arrival_s - records[0].request.arrival_s if records else 0.0
    if n < MIN_REQUESTS or span <= 0:
        return None
    offered_req_s = (n - 1) / span
    offered_tok_s = offered_req_s * metrics.output_tokens / n
    quarter = n // 4
    first = float(np.mean([r.ttft_s for r in records[:quarter]]))
    last = float(np.mean([r.ttft_s for r in records[-quarter:]]))
    overloaded = metrics.throughput_tok_s < SERVED_SHARE * offered_tok_s and last > TTFT_GROWTH * first
    return LoadCheck(
        offered_req_s, offered_tok_s, metrics.throughput_req_s, metrics.throughput_tok_s,
        first, last, overloaded, planner_tok_s,
    )  # fmt: skip
