"""Workload files: how long prompts and outputs are, and how many requests are in flight.

    name: chat
    prompt_tokens: {mean: 512, p99: 2048}    # a number, {mean, p99 and/or max}, or {samples: [...]}
    output_tokens: {mean: 256, max: 1024}
    arrival_rate_per_s: 4.0                   # online serving ... or
    # batch_size: 64                          # ... an offline batch (exactly one of the two)
    max_micro_batch: 8                        # most micro-batches the pipeline keeps in flight

What the planner reads from it (all derived, documented at each property):

- `requests_in_flight` R: the batch size; or, for a request stream, Little's law
  R = ceil(arrival_rate * latency), with latency = `latency_estimate_s` when given, else
  output_tokens.mean * NOMINAL_TPOT_S (decode dominates a chat request's time in the system).
- `micro_batches` m = min(R, max_micro_batch): the pipeline splits R requests into m micro-batches
  of `micro_batch_size` = ceil(R / m) requests.
- `alpha_f` = 1 / (m - 1), or inf when m = 1: the weight of the bottleneck stage in the planner's
  objective sum_j T_j + (1/alpha_f) max_j T_j, which is then the pipeline makespan of m micro-batches.
- `alpha_r` = mean KV tokens of a request / `max_kv_tokens`: how full the KV cache sized for the
  worst case is on average (request pressure, in (0, 1]).
- `max_kv_tokens` = prompt max + output max: one request's KV at full length.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tessel.catalog.yaml_reader import bundled_names, parse_yaml, resolve_file, validate_data

# Bounds on workload values: beyond them no planner or simulator input makes sense, and numbers
# stay far from int64 / float overflow. 2**24 tokens (16.8M) is above any model's context window.
MAX_TOKENS = 2**24
MAX_BATCH_SIZE = 1_000_000
MAX_ARRIVAL_RATE_PER_S = 1e6
MAX_MICRO_BATCHES = 1024
MAX_LATENCY_S = 1e7
MAX_SAMPLES = 1_000_000
_FILE_MODEL = ConfigDict(extra="forbid", allow_inf_nan=False)

Z_99 = 2.3263478740408408  # standard normal 99th percentile

# Time per output token assumed when estimating a request's latency for Little's law: 50 ms
# (20 tokens/s, faster than people read, a common interactive serving target).
NOMINAL_TPOT_S = 0.05


class TokenDistribution(BaseModel):
    """A length distribution: a mean with optional p99/max, or samples (mean and max from them)."""

    model_config = _FILE_MODEL

    mean: float | None = Field(default=None, gt=0, le=MAX_TOKENS)
    p99: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    samples: list[int] | None = Field(default=None, min_length=1, max_length=MAX_SAMPLES)

    @model_validator(mode="after")
    def _consistent(self) -> TokenDistribution:
        if self.samples is not None:
            if any(not 1 <= sample <= MAX_TOKENS for sample in self.samples):
                raise ValueError(f"samples must be token counts from 1 to {MAX_TOKENS}")
            if self.mean is not None or self.p99 is not None or self.max is not None:
                raise ValueError("give either samples or mean/p99/max, not both")
            return self
        if self.mean is None:
            raise ValueError("a token distribution needs a mean (or samples)")
        order = [value for value in (self.mean, self.p99, self.max) if value is not None]
        if order != sorted(order):
            raise ValueError(f"need mean <= p99 <= max, got mean={self.mean}, p99={self.p99}, max={self.max}")
        return self

    @property
    def mean_tokens(self) -> float:
        return sum(self.samples) / len(self.samples) if self.samples is not None else float(self.mean)

    @property
    def max_tokens(self) -> int:
        """The length to size memory for: max, else p99, else the largest sample, else the mean."""
        if self.samples is not None:
            return max(self.samples)
        for value in (self.max, self.p99):
            if value is not None:
                return value
        return math.ceil(self.mean)


class SloSpec(BaseModel):
    """Latency targets a serving run must meet (`tessel simulate` checks them; `--goodput` finds the
    highest arrival rate that does)."""

    model_config = _FILE_MODEL

    ttft_p90_s: float = Field(gt=0, le=MAX_LATENCY_S)
    tpot_p90_s: float = Field(gt=0, le=MAX_LATENCY_S)


class Workload(BaseModel):
    model_config = _FILE_MODEL

    name: str = Field(min_length=1)
    description: str = ""
    prompt_tokens: TokenDistribution
    output_tokens: TokenDistribution
    arrival_rate_per_s: float | None = Field(default=None, gt=0, le=MAX_ARRIVAL_RATE_PER_S)
    batch_size: int | None = Field(default=None, ge=1, le=MAX_BATCH_SIZE)
    latency_estimate_s: float | None = Field(default=None, gt=0, le=MAX_LATENCY_S)
    max_micro_batch: int = Field(default=8, ge=1, le=MAX_MICRO_BATCHES)
    slo: SloSpec | None = None

    @field_validator("prompt_tokens", "output_tokens", mode="before")
    @classmethod
    def _number_is_a_mean(cls, value: object) -> object:
        return {"mean": value} if isinstance(value, int | float) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _one_source_of_requests(self) -> Workload:
        if (self.arrival_rate_per_s is None) == (self.batch_size is None):
            raise ValueError("give exactly one of arrival_rate_per_s (online) or batch_size (offline)")
        if self.latency_estimate_s is not None and self.arrival_rate_per_s is None:
            raise ValueError("latency_estimate_s only applies with arrival_rate_per_s")
        return self

    @property
    def request_latency_s(self) -> float:
        """Time a request spends in the system, for Little's law."""
        if self.latency_estimate_s is not None:
            return self.latency_estimate_s
        return self.output_tokens.mean_tokens * NOMINAL_TPOT_S

    @property
    def requests_in_flight(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return max(1, math.ceil(self.arrival_rate_per_s * self.request_latency_s))

    @property
    def micro_batches(self) -> int:
        return min(self.requests_in_flight, self.max_micro_batch)

    @property
    def micro_batch_size(self) -> int:
        """Requests per micro-batch: ceil(R / m)."""
        return math.ceil(self.requests_in_flight / self.micro_batches)

    @property
    def alpha_f(self) -> float:
        m = self.micro_batches
        return math.inf if m == 1 else 1.0 / (m - 1)

    @property
    def max_kv_tokens(self) -> int:
        return self.prompt_tokens.max_tokens + self.output_tokens.max_tokens

    @property
    def mean_kv_tokens(self) -> float:
        return self.prompt_tokens.mean_tokens + self.output_tokens.mean_tokens

    @property
    def alpha_r(self) -> float:
        return min(1.0, self.mean_kv_tokens / self.max_kv_tokens)

    @property
    def mean_decode_context_tokens(self) -> float:
        """Average context of a request over its decode steps: prompt + half the output."""
        return self.prompt_tokens.mean_tokens + self.output_tokens.mean_tokens / 2

    def with_in_flight(self, in_flight: int) -> Workload:
        """The workload as a plan carrying `in_flight` micro-batches writes it: unchanged, unless
        memory concurrency put more in flight than it asked for (the plan file's m is then the total)."""
        if in_flight <= self.micro_batches:
            return self
        update = {
            "batch_size": in_flight * self.micro_batch_size,
            "arrival_rate_per_s": None,
            "latency_estimate_s": None,
            "max_micro_batch": in_flight,
        }
        return self.model_copy(update=update)


def lognormal_sigma(mean: float, p99: float) -> float:
    """sigma of the lognormal with this mean whose 99th percentile is p99: solving
    exp(mu + z sigma) = p99 with mu = ln(mean) - sigma^2 / 2 gives sigma = z - sqrt(z^2 - 2 ln(p99 / mean)),
    z = 2.326; when p99 / mean exceeds exp(z^2 / 2) (no solution) sigma = z. The simulator draws
    lengths from it (`tessel.sim.request_trace`) and the online planner reads its quantiles."""
    log_ratio = math.log(p99 / mean)
    discriminant = Z_99**2 - 2 * log_ratio
    return Z_99 if discriminant < 0 else Z_99 - math.sqrt(discriminant)


def list_bundled_workloads() -> list[str]:
    return bundled_names("workloads")


def load_workload(path_or_name: str | Path) -> Workload:
    """A workload from a YAML file, or a bundled workload by name (e.g. "default")."""
    text, label = resolve_file(path_or_name, "workloads", "workload")
    return parse_yaml(text, label, Workload)


def parse_workload(data: dict, *, source: str = "<workload>") -> Workload:
    """A workload from an already-parsed mapping of the same shape as a workload file."""
    return validate_data(data, source, Workload)
