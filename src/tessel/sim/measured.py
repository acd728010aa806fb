"""Measured serving metrics of a `tessel launch` run, and the run file `tessel simulate --measured` reads.

`measured_metrics(requests, wall_s)` turns the per-request records `run_pipeline` returns into the
metrics `tessel plan` and `tessel simulate` predict, by the same definitions (`sim_metrics`):
TTFT = first token - arrival, TPOT = (finish - first token) / (output tokens - 1) (one-token
requests have none), throughput = output tokens / wall, where wall is stage 0's generate from the
first request added to the last token (a closed batch all added at t = 0, so it is the makespan).

`load_run(path)` reads a `tessel launch --json` file: its `run` section names the plan (model,
cluster, stage layers) and the scheduler settings the run used, its `requests` the token counts.
Pure Python: never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from tessel.errors import TesselError
from tessel.files import read_json_file
from tessel.sim.requests import Request
from tessel.sim.sim_metrics import Summary

RUN_FILE_VERSION = 1
METRICS = ("ttft_s", "tpot_s", "throughput_tok_s")  # what plan, simulate and launch all report


@dataclass(frozen=True, slots=True)
class MeasuredMetrics:
    requests: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: Summary
    tpot_s: Summary
    wall_s: float
    throughput_tok_s: float  # output tokens / wall_s

    def to_json(self) -> dict:
        return asdict(self)


def measured_metrics(requests: list[dict], wall_s: float) -> MeasuredMetrics:
    """The metrics of a run from its per-request records (`ttft_s`, `tpot_s`, `num_prompt_tokens`,
    `num_output_tokens`; a missing or None latency is no sample) and its wall time in seconds."""
    if not requests:
        raise TesselError("a run with no requests has no metrics")
    if not (math.isfinite(wall_s) and wall_s > 0):
        raise TesselError(f"wall_s must be a finite time > 0 s, got {wall_s}")
    output_tokens = sum(int(r["num_output_tokens"]) for r in requests)
    ttfts = [float(r["ttft_s"]) for r in requests if r.get("ttft_s") is not None]
    tpots = [float(r["tpot_s"]) for r in requests if r.get("tpot_s") is not None]
    return MeasuredMetrics(
        requests=len(requests),
        prompt_tokens=sum(int(r.get("num_prompt_tokens", 0)) for r in requests),
        output_tokens=output_tokens,
        ttft_s=Summary.of(ttfts),
        tpot_s=Summary.of(tpots),
        wall_s=wall_s,
        throughput_tok_s=output_tokens / wall_s,
    )


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """What a launch ran: the plan's model, cluster and stage layers, and its scheduler settings."""

    plan: str  # the plan file's path as given to launch
    model_name: str  # the plan's model name
    cluster_name: str
    stage_layers: tuple[tuple[int, int], ...]  # [layer_start, layer_end) per stage
    replica: int | None
    micro_batches: int  # in flight (launch's --micro-batches, or the plan's m)
    max_num_seqs: int  # per in-flight slot (each slot has its own scheduler)
    max_num_batched_tokens: int

    def to_json(self) -> dict:
        data = asdict(self)
        data["stage_layers"] = [list(pair) for pair in self.stage_layers]
        return data


@dataclass(frozen=True, slots=True)
class MeasuredRun:
    path: Path
    identity: RunIdentity
    requests: list[Request]  # all at t = 0: launch adds them as one closed batch
    metrics: MeasuredMetrics


def load_run(path: str | Path) -> MeasuredRun:
    """A `tessel launch --json` file; a `TesselError` naming the field for anything else."""
    path = Path(path)
    data = read_json_file(path, "run file")
    where = f"run file {path}"
    if not isinstance(data, dict) or not isinstance(data.get("run"), dict):
        raise TesselError(f"{where}: no `run` section; give the --json file of `tessel launch`")
    if data.get("version") != RUN_FILE_VERSION:
        raise TesselError(f"{where}: version {data.get('version')!r}, this tessel reads {RUN_FILE_VERSION}")
    identity = _identity(data["run"], where)
    records = data.get("requests")
    if not isinstance(records, list) or not records:
        raise TesselError(f"{where}: `requests` must be a non-empty list of the run's requests")
    requests = []
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise TesselError(f"{where}: requests[{i}] is not an object")
        prompt = _count(record, "num_prompt_tokens", f"{where}: requests[{i}]")
        output = _count(record, "num_output_tokens", f"{where}: requests[{i}]")
        for key in ("ttft_s", "tpot_s"):
            value = record.get(key)
            if value is not None and not (_is_number(value) and math.isfinite(value) and value >= 0):
                raise TesselError(f"{where}: requests[{i}].{key} must be >= 0 s or null, not {value!r}")
        requests.append(Request(i, 0.0, prompt, output))
    wall = data.get("wall_s")
    if not (_is_number(wall) and math.isfinite(wall) and wall > 0):
        raise TesselError(f"{where}: wall_s must be a time > 0 s, got {wall!r}")
    return MeasuredRun(path, identity, requests, measured_metrics(records, float(wall)))


def _identity(run: dict, where: str) -> RunIdentity:
    layers = run.get("stage_layers")
    if not (
        isinstance(layers, list)
        and layers
        and all(isinstance(p, list) and len(p) == 2 and all(_is_int(v) for v in p) for p in layers)
    ):
        raise TesselError(f"{where}: run.stage_layers must be a list of [layer_start, layer_end] pairs")
    for key in ("plan", "model_name", "cluster_name"):
        if not isinstance(run.get(key), str):
            raise TesselError(f"{where}: run.{key} must be a string")
    replica = run.get("replica")
    if replica is not None and not _is_int(replica):
        raise TesselError(f"{where}: run.replica must be an integer or null, got {replica!r}")
    return RunIdentity(
        plan=run["plan"],
        model_name=run["model_name"],
        cluster_name=run["cluster_name"],
        stage_layers=tuple((int(a), int(b)) for a, b in layers),
        replica=replica,
        micro_batches=_count(run, "micro_batches", f"{where}: run"),
        max_num_seqs=_count(run, "max_num_seqs", f"{where}: run"),
        max_num_batched_tokens=_count(run, "max_num_batched_tokens", f"{where}: run"),
    )


def check_same_plan(identity: RunIdentity, plan_file, stages, where: str) -> None:  # noqa: ANN001
    """Refuse a run of another plan: its model, cluster or stage layers differ from PLAN's."""
    layers = tuple((s.layer_start, s.layer_end) for s in stages)
    differences = [
        f"{name}: run {ran!r}, plan {planned!r}"
        for name, ran, planned in (
            ("model", identity.model_name, plan_file.model_name),
            ("cluster", identity.cluster_name, plan_file.cluster_name),
            ("stage layers", _ranges(identity.stage_layers), _ranges(layers)),
        )
        if ran != planned
    ]
    if differences:
        raise TesselError(
            f"{where} was measured with another plan ({identity.plan}); it differs from "
            f"{plan_file.path} in {'; '.join(differences)}. Launch this plan, or simulate that one"
        )


@dataclass(frozen=True, slots=True)
class MetricComparison:
    label: str  # "TTFT p50", "throughput"
    key: str  # "ttft_s.p50", "throughput_tok_s"
    unit: str  # "ms" (values in seconds) or "tok/s"
    predicted: float
    measured: float
    error: float  # (predicted - measured) / measured

    def to_json(self) -> dict:
        return asdict(self)


def compare_metrics(predicted, measured: MeasuredMetrics) -> list[MetricComparison]:  # noqa: ANN001
    """Rows of predicted (`tessel.sim.sim_metrics.Metrics`) against measured: TTFT and TPOT p50,
    p99 and mean, and throughput."""
    rows = []
    for label, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s")):
        for stat in ("p50", "p99", "mean"):
            p, m = getattr(getattr(predicted, key), stat), getattr(getattr(measured, key), stat)
            error = relative_error(p, m)
            rows.append(MetricComparison(f"{label} {stat}", f"{key}.{stat}", "ms", p, m, error))
    p, m = predicted.throughput_tok_s, measured.throughput_tok_s
    rows.append(MetricComparison("throughput", "throughput_tok_s", "tok/s", p, m, relative_error(p, m)))
    return rows


@dataclass(frozen=True, slots=True)
class MeasuredComparison:
    run: MeasuredRun
    rows: list[MetricComparison]

    def to_json(self) -> dict:
        return {
            "run_file": str(self.run.path),
            "run": self.run.identity.to_json(),
            "metrics": self.run.metrics.to_json(),
            "comparison": [row.to_json() for row in self.rows],
        }


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; NaN when either is missing or measured is 0."""
    if math.isnan(predicted) or math.isnan(measured) or measured == 0:
        return float("nan")
    return (predicted - measured) / measured


def _ranges(layers: tuple[tuple[int, int], ...]) -> str:
    return ", ".join(f"{a}-{b - 1}" for a, b in layers)


def _count(record: dict, key: str, where: str) -> int:
    value = record.get(key)
    if not (_is_int(value) and value >= 1):
        raise TesselError(f"{where}.{key} must be an integer >= 1, got {value!r}")
    return int(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
