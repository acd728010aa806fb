"""The requests a simulation serves: Poisson arrivals, a closed batch, or a trace file.

A trace is a CSV with the header `arrival_s,prompt_tokens,output_tokens` (one request per row), or
JSONL with one object per line holding those keys. A bad row raises `TesselError` naming the file,
the line and the field. `output_tokens` counts every generated token, the first one included (the
first comes out of the prefill, the others out of decode steps).
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessel.errors import TesselError
from tessel.files import parse_json_text, read_text_file
from tessel.plan.files.workload import MAX_TOKENS

TRACE_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens")
LENGTH_KINDS = ("fixed", "uniform", "lognormal", "samples")


@dataclass(frozen=True, slots=True)
class Request:
    id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"request {self.id}: arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(
                f"request {self.id}: prompt_tokens and output_tokens must be >= 1, "
                f"got {self.prompt_tokens} and {self.output_tokens}"
            )


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Token lengths: `fixed` (= mean), `uniform` on [low, high], `lognormal` (mean, sigma of the
    log), or `samples` (drawn uniformly from the given values, an empirical distribution).

    Draws are rounded and clipped to [low, high] (low >= 1).
    """

    kind: str = "fixed"
    mean: float = 512.0
    low: int = 1
    high: int = 1 << 20
    sigma: float = 0.5
    samples: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length distribution kind {self.kind!r} not in {LENGTH_KINDS}")
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"need 1 <= low <= high, got low={self.low} high={self.high}")
        if self.mean <= 0 or self.sigma < 0:
            raise ValueError(f"need mean > 0 and sigma >= 0, got mean={self.mean} sigma={self.sigma}")
        if (self.kind == "samples") != bool(self.samples):
            raise ValueError("kind 'samples' needs samples, and samples need kind 'samples'")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            values = np.full(n, self.mean)
        elif self.kind == "uniform":
            values = rng.integers(self.low, self.high + 1, size=n).astype(float)
        elif self.kind == "samples":
            values = rng.choice(np.asarray(self.samples, dtype=float), size=n)
        else:  # lognormal with the given mean: mu = log(mean) - sigma^2 / 2
            values = rng.lognormal(math.log(self.mean) - self.sigma**2 / 2, self.sigma, size=n)
        return np.clip(np.rint(values), self.low, self.high).astype(int)


def poisson_requests(
    n: int,
    rate_per_s: float,
    prompt: LengthDistribution,
    output: LengthDistribution,
    seed: int = 0,
) -> list[Request]:
    """n requests whose inter-arrival times are exponential with mean 1/rate (first at t = 0)."""
    if n < 1:
        raise TesselError(f"need at least one request, got {n}")
    if not rate_per_s > 0:
        raise TesselError(f"arrival rate must be > 0 requests/s, got {rate_per_s}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate_per_s, size=n)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)
    prompts, outputs = prompt.sample(rng, n), output.sample(rng, n)
    return [Request(i, float(arrivals[i]), int(prompts[i]), int(outputs[i])) for i in range(n)]


def batch_requests(
    n: int, prompt: LengthDistribution, output: LengthDistribution, seed: int = 0
) -> list[Request]:
    """n requests that all arrive at t = 0 (an offline batch)."""
    if n < 1:
        raise TesselError(f"need at least one request, got {n}")
    rng = np.random.default_rng(seed)
    prompts, outputs = prompt.sample(rng, n), output.sample(rng, n)
    return [Request(i, 0.0, int(prompts[i]), int(outputs[i])) for i in range(n)]


def load_trace(path: str | Path) -> list[Request]:
    """Requests from a CSV or JSONL trace (by extension: .csv, .jsonl/.json), sorted by arrival."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".jsonl", ".json", ".ndjson"):
        raise TesselError(f"trace file {path}: unknown extension {suffix!r} (use .csv or .jsonl)")
    text = read_text_file(path, "trace file")
    rows = _csv_rows(path, text) if suffix == ".csv" else _jsonl_rows(path, text)
    requests = [_request(path, line, row, index) for index, (line, row) in enumerate(rows)]
    if not requests:
        raise TesselError(f"trace file {path} holds no requests")
    requests.sort(key=lambda request: (request.arrival_s, request.id))
    return requests


def _csv_rows(path: Path, text: str) -> list[tuple[int, dict]]:
    try:
        return _csv_records(path, csv.reader(io.StringIO(text, newline="")))
    except csv.Error as error:  # a NUL byte, an over-long field, a broken quote
        raise TesselError(f"{path}: not a valid CSV trace ({error})") from None


def _csv_records(path: Path, reader) -> list[tuple[int, dict]]:  # noqa: ANN001 (a csv.reader)
    header = next(reader, None)
    if header is None:
        raise TesselError(f"{path}: empty file, expected the header {','.join(TRACE_FIELDS)}")
    header = [name.strip() for name in header]
    missing = [name for name in TRACE_FIELDS if name not in header]
    if missing:
        raise TesselError(f"{path}:1: header lacks {', '.join(missing)} (expected {','.join(TRACE_FIELDS)})")
    rows = []
    for values in reader:
        if not any(value.strip() for value in values):
            continue
        line = reader.line_num
        if len(values) != len(header):
            raise TesselError(f"{path}:{line}: {len(values)} fields, the header has {len(header)}")
        rows.append((line, dict(zip(header, values, strict=True))))
    return rows


def _jsonl_rows(path: Path, text: str) -> list[tuple[int, dict]]:
    rows = []
    for line, row_text in enumerate(text.splitlines(), start=1):
        if not row_text.strip():
            continue
        row = parse_json_text(row_text, f"{path}:{line}")
        if not isinstance(row, dict):
            raise TesselError(f"{path}:{line}: expected an object with keys {', '.join(TRACE_FIELDS)}")
        rows.append((line, row))
    return rows


def _request(path: Path, line: int, row: dict, index: int) -> Request:
    for name in TRACE_FIELDS:
        if name not in row:
            raise TesselError(f"{path}:{line}: field {name!r} is missing")
    arrival = _number(path, line, "arrival_s", row["arrival_s"], integer=False)
    if not math.isfinite(arrival) or arrival < 0:
        raise TesselError(f"{path}:{line}: field 'arrival_s' must be a finite number >= 0, got {arrival}")
    lengths = []
    for name in ("prompt_tokens", "output_tokens"):
        value = _number(path, line, name, row[name], integer=True)
        if value < 1:
            raise TesselError(f"{path}:{line}: field {name!r} must be an integer >= 1, got {value}")
        if value > MAX_TOKENS:
            raise TesselError(f"{path}:{line}: field {name!r} is {value:.0f}; at most {MAX_TOKENS} tokens")
        lengths.append(int(value))
    return Request(index, arrival, lengths[0], lengths[1])


def _number(path: Path, line: int, name: str, raw: object, *, integer: bool) -> float:
    kind = "an integer" if integer else "a number"
    if isinstance(raw, bool):
        raise TesselError(f"{path}:{line}: field {name!r} must be {kind}, got {raw!r}")
    try:
        value = float(raw.strip()) if isinstance(raw, str) else float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # OverflowError: a JSON integer beyond any float
        raise TesselError(f"{path}:{line}: field {name!r} must be {kind}, got {_short(raw)}") from None
    if integer and not (math.isfinite(value) and value == int(value)):
        raise TesselError(f"{path}:{line}: field {name!r} must be {kind}, got {_short(raw)}")
    return value


def _short(raw: object, limit: int = 60) -> str:
    text = repr(raw)
    return text if len(text) <= limit else text[:limit] + "..."
