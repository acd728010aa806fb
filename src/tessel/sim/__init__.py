"""Discrete-event simulation of a plan serving a workload: latency, throughput, bubbles, Gantt charts.

One concern per module: `requests` (Poisson, batch, traces), `scheduler` (continuous batching with
chunked prefill), `simulator` (event heap, stages, links), `metrics`, `gantt`, `linear` (a stage given
by coefficients), `cpp` (prompt cuts from `tessel.chunk`), `plan_pipeline` (a plan file's stages,
read by `tessel.plan.files.plan_file`, priced by the cost model), `workload` (requests for `--workload`).
Pure Python and numpy: never imports torch. `gantt` imports matplotlib only when called.
"""

from __future__ import annotations

from tessel.sim.gantt import plot_gantt
from tessel.sim.linear import LinearStage
from tessel.sim.requests import LengthDistribution, Request, batch_requests, load_trace, poisson_requests
from tessel.sim.scheduler import MicroBatch, SimSchedulerConfig, Work
from tessel.sim.sim_metrics import Metrics, Summary, compute_metrics
from tessel.sim.simulator import Interval, RequestRecord, SimConfig, SimResult, Simulator, simulate

__all__ = [
    "Interval",
    "LengthDistribution",
    "LinearStage",
    "Metrics",
    "MicroBatch",
    "Request",
    "RequestRecord",
    "SimSchedulerConfig",
    "SimConfig",
    "SimResult",
    "Simulator",
    "Summary",
    "Work",
    "batch_requests",
    "compute_metrics",
    "load_trace",
    "plot_gantt",
    "poisson_requests",
    "simulate",
]
