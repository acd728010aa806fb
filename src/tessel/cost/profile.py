"""Measured per-layer timings that replace the analytic roofline for one device type.

`tessel profile` times one real decoder layer over a grid and fits, per layer,

    prefill:  t(c, p) = a0 + a1*c + a2*p + a3*c*(p + c/2)          (c chunk tokens at offset p)
    decode:   t(B, S) = b0 + b1*B + b2*S                             (B sequences, S = sum of contexts)
              (or g(B) + b2*S, g piecewise-linear through `DecodeFit.knots`: `tessel.cost.fit`)

and writes them as JSON (`PROFILE_VERSION`). The cost model uses a profile for the device type
and model shape it was measured on; for another model shape it falls back to the efficiencies
the fit implies (`compute_efficiency`, `memory_efficiency`), or to the catalog defaults; the
commands refuse such a profile unless forced (`tessel.cost.profile_check`). `meta.tessel_version`
records the tessel that wrote the file.

Version 2 adds the other things the planner prices, each an affine fit `t(x) = c0 + c1*x` with its
held-out error (`ComponentFit`, keyed in `Profile.components`):

    "embed"           the embedding gather of x tokens (first stage)
    "head"            final norm + LM head + greedy sampling of x rows (last stage)
    "step"            the engine's per-step work outside the model (scheduling, input preparation,
                      appending tokens and the stop checks) for a step of x sequences
    "prefill_batch"   one pass of one decoder layer over x sequences' prefill chunks of
                      `shape["chunk_tokens"]` tokens each: its intercept c0 is what a pass pays once
                      (`tessel.cost.roofline.prefill_shared_s`)
    "transport:host"  one stage-to-stage message (header, metadata, x bytes of hidden states) over
                      gloo between two processes of one host ("transport:nccl" on CUDA)
    "contention:decode"  not seconds: the decode layer's slowdown factor with x stages computing
                      beside it on its CPU host (c0 = 1; `tessel.profiling.contention`);
                      "contention:prefill" likewise, where a profile has it

and the host's usable cores (`cpu_cores`) and the threads it was timed with (`threads`): CPU stages
on one host share those cores (`tessel.chunk.from_plan`). A version-1 file still loads (no
components: the roofline prices them); any other version is refused. Every fitted term is checked
when its fit is made (read from a file, fitted, or built through the Python API): in [0, MAX_TERM_S]
at its unit, else refused naming the file, the fit and the term.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tessel.catalog.yaml_reader import validate_data
from tessel.errors import TesselError
from tessel.files import read_json_file

PROFILE_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: the decoder-layer fits alone
# Longest a fitted term may take at its unit (a pass, a token, a sequence, a byte): a minute. A decoder
# layer of the largest catalog model (OPT-66B, ~1e9 matmul weights) takes about 1 ms per token on the
# catalog's cpu (2 FLOP per weight at 2.56 TFLOP/s), and a pass streaming its 4 GB of fp32 weights at
# 10 GB/s 0.4 s: a term past this is no measurement, and would price every plan alike.
MAX_TERM_S = 60.0
COMPONENTS = ("embed", "head", "step", "prefill_batch", "contention:decode", "contention:prefill")
PREFILL_BATCH = "prefill_batch"
TRANSPORT_PREFIX = "transport:"
VERSION_KEY = "tessel_version"  # meta: the tessel that wrote the file (`tessel.cost.profile_check`)


class ImplausibleFit(TesselError, ValueError):
    """A fitted time no measurement gives: negative, not a number, or over `MAX_TERM_S` at its unit."""


def _check_terms(terms: dict[str, tuple[float, str]]) -> None:
    """Refuse the first term (name -> (seconds, "per <unit>")) that is not in [0, MAX_TERM_S]."""
    for name, (seconds, unit) in terms.items():
        shown = f"{name} = {seconds:g} s{' ' + unit if unit else ''}"
        if not seconds >= 0:
            raise ImplausibleFit(f"{shown}: a fitted time is never negative (or not a number)")
        if seconds > MAX_TERM_S:
            raise ImplausibleFit(f"{shown}: above {MAX_TERM_S:g} s, slower than any device (MAX_TERM_S)")


def _check_knots(knots: list[tuple[float, float]]) -> None:
    _check_terms({f"knots[{i}]": (seconds, "") for i, (_, seconds) in enumerate(knots)})


@dataclass(frozen=True, slots=True)
class PrefillFit:
    a0: float
    a1: float
    a2: float
    a3: float

    def __post_init__(self) -> None:
        _check_terms(
            {
                "a0": (self.a0, "per pass"),
                "a1": (self.a1, "per token"),
                "a2": (self.a2, "per cached token"),
                "a3": (self.a3, "per token x attended token"),
            }
        )

    def time_s(self, chunk_tokens: float, offset_tokens: float) -> float:
        c, p = chunk_tokens, offset_tokens
        return self.a0 + self.a1 * c + self.a2 * p + self.a3 * c * (p + c / 2)


@dataclass(frozen=True, slots=True)
class DecodeFit:
    """b0 + b1*B + b2*S; with `knots` ((batch, seconds) points), g(B) + b2*S where g is the line
    through them (a GEMM's time is a staircase in its rows: `tessel.cost.fit`), b0 + b1*B then only
    summarising g. Files without knots (older profiles) read as the affine form."""

    b0: float
    b1: float
    b2: float
    knots: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_terms(
            {
                "b0": (self.b0, "per step"),
                "b1": (self.b1, "per sequence"),
                "b2": (self.b2, "per context token"),
            }
        )
        _check_knots(self.knots)

    def time_s(self, batch_size: float, sum_context_tokens: float) -> float:
        if len(self.knots) < 2:
            return self.b0 + self.b1 * batch_size + self.b2 * sum_context_tokens
        return _through(self.knots, batch_size) + self.b2 * sum_context_tokens


def _through(knots: list[tuple[float, float]], x: float) -> float:
    """The line through sorted `knots` at x, extended by the end segments, floored at 0."""
    i = bisect.bisect_left(knots, (x, -math.inf))
    (x0, t0), (x1, t1) = knots[min(max(i - 1, 0), len(knots) - 2) :][:2]
    return max(t0 + (t1 - t0) * (x - x0) / (x1 - x0), 0.0)


@dataclass(frozen=True, slots=True)
class ComponentFit:
    """t(x) = c0 + c1 * x for one priced component; x counts `unit` (tokens, rows, sequences, bytes).
    With `knots` (sorted (x, seconds) points), t is instead the line through them, extended by the
    end segments (a component whose cost per unit changes with size, as a gather once its rows
    leave the cache); c0, c1 then summarise it. `shape` names the sizes it was timed at
    (hidden_size, vocab_size): it prices only those."""

    c0: float
    c1: float
    unit: str
    heldout_rel_error: float  # mean |pred - meas| / meas on points left out of the fit
    n_points: int
    shape: dict[str, int] = field(default_factory=dict)
    knots: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_terms({"c0": (self.c0, "per call"), "c1": (self.c1, f"per {self.unit.removesuffix('s')}")})
        _check_knots(self.knots)

    def time_s(self, x: float) -> float:
        if len(self.knots) < 2:
            return self.c0 + self.c1 * x
        return _through(self.knots, x)

    def matches(self, shape: dict[str, int]) -> bool:
        return all(self.shape.get(key) == value for key, value in shape.items())


def transport_key(transport: str) -> str:
    """The `components` key of a transport ("host", "nccl")."""
    return TRANSPORT_PREFIX + transport


@dataclass(frozen=True, slots=True)
class Profile:
    device_type: str  # catalog name ("cpu", "A100-80G", ...)
    model_shape: dict[str, int]  # hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim
    dtype: str
    prefill: PrefillFit  # seconds per decoder layer
    decode: DecodeFit  # seconds per decoder layer
    heldout_rel_error: float  # mean |pred - meas| / meas on grid points left out of the fit
    compute_efficiency: float | None = None  # achieved / peak FLOP/s implied by the fit
    memory_efficiency: float | None = None  # achieved / peak bytes/s implied by the fit
    meta: dict[str, str] = field(default_factory=dict)  # host, torch version, threads, date
    components: dict[str, ComponentFit] = field(default_factory=dict)  # see the module docstring
    cpu_cores: int | None = None  # cores this host gave the profiling process (CPU profiles)
    threads: int | None = None  # torch threads the timings ran with

    def component(self, name: str, shape: dict[str, int] | None = None) -> ComponentFit | None:
        """The fit of `name` when the profile has one timed at `shape` (None: price it otherwise)."""
        fit = self.components.get(name)
        return fit if fit is not None and fit.matches(shape or {}) else None

    def matches(self, device_type: str, model_shape: dict[str, int]) -> bool:
        return self.device_type == device_type and all(
            self.model_shape.get(key) == value for key, value in model_shape.items()
        )

    def to_json(self) -> dict:
        """The file's JSON; `meta` gains this tessel's version unless the profile records one."""
        from tessel import __version__

        data = asdict(self)
        data["meta"] = {VERSION_KEY: __version__} | data["meta"]
        return {"version": PROFILE_VERSION, **data}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


class _PrefillFitModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    a0: float
    a1: float
    a2: float
    a3: float


class _DecodeFitModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    b0: float
    b1: float
    b2: float
    knots: list[list[float]] = []

    @field_validator("knots")
    @classmethod
    def _increasing(cls, knots: list[list[float]]) -> list[list[float]]:
        return _ComponentModel._increasing(knots)


class _ComponentModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    c0: float  # in [0, MAX_TERM_S]: checked by ComponentFit, as every fit's terms
    c1: float
    unit: str = Field(min_length=1)
    heldout_rel_error: float = Field(ge=0)
    n_points: int = Field(ge=1)
    shape: dict[str, int] = {}
    knots: list[list[float]] = []

    @field_validator("knots")
    @classmethod
    def _increasing(cls, knots: list[list[float]]) -> list[list[float]]:
        if any(len(knot) != 2 for knot in knots):
            raise ValueError("each knot is [size, seconds]")
        xs = [x for x, _ in knots]
        if any(b <= a for a, b in zip(xs[:-1], xs[1:], strict=True)):
            raise ValueError("knots need strictly increasing sizes")
        return knots  # their times: checked by the fit, as every term


class _ProfileModel(BaseModel):
    """The profile file as written by `Profile.to_json`, checked field by field."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    version: int
    device_type: str = Field(min_length=1)
    model_shape: dict[str, int]
    dtype: str
    prefill: _PrefillFitModel
    decode: _DecodeFitModel
    heldout_rel_error: float = Field(ge=0)
    compute_efficiency: float | None = Field(default=None, gt=0)
    memory_efficiency: float | None = Field(default=None, gt=0)
    meta: dict[str, str | int | float | bool | None] = {}
    components: dict[str, _ComponentModel] = {}
    cpu_cores: int | None = Field(default=None, ge=1)
    threads: int | None = Field(default=None, ge=1)


def load_profile(path: str | Path) -> Profile:
    """A profile written by `tessel profile`; a broken file raises `TesselError` naming the field."""
    path = Path(path)
    if not path.exists():
        raise TesselError(f"profile file {path} does not exist (make one with `tessel profile`)")
    data = read_json_file(path, "profile file")
    if not isinstance(data, dict):
        raise TesselError(f"{path}: a profile file holds a JSON object")
    version = data.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise TesselError(
            f"{path}: profile version {version!r:.40}; this tessel reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))} (profile again with `tessel profile`)"
        )
    model = validate_data(data, str(path), _ProfileModel)
    unknown = sorted(set(model.components) - set(COMPONENTS) - {k for k in model.components if _transport(k)})
    if unknown:
        raise TesselError(
            f"{path}: unknown profile component {unknown[0]!r:.60}; known: {', '.join(COMPONENTS)}, "
            f"{TRANSPORT_PREFIX}<name>"
        )
    return Profile(
        device_type=model.device_type,
        model_shape=dict(model.model_shape),
        dtype=model.dtype,
        prefill=_fit(path, "prefill", PrefillFit, model.prefill.model_dump()),
        decode=_fit(path, "decode", DecodeFit, _with_knots(model.decode)),
        heldout_rel_error=model.heldout_rel_error,
        compute_efficiency=model.compute_efficiency,
        memory_efficiency=model.memory_efficiency,
        meta={key: str(value) for key, value in model.meta.items()},
        components={
            name: _fit(path, f"components.{name}", ComponentFit, _with_knots(fit))
            for name, fit in model.components.items()
        },
        cpu_cores=model.cpu_cores,
        threads=model.threads,
    )


def _fit(path: Path, where: str, cls: type, fields: dict):  # noqa: ANN202 (a fit of `cls`)
    """`cls(**fields)`; an implausible term is refused naming the file, the fit and the term."""
    try:
        return cls(**fields)
    except ImplausibleFit as error:
        raise TesselError(f"{path}: {where}.{error}; profile again with `tessel profile`") from None


def _with_knots(model: BaseModel) -> dict:
    return model.model_dump() | {"knots": [tuple(knot) for knot in model.knots]}


def _transport(key: str) -> bool:
    return key.startswith(TRANSPORT_PREFIX) and len(key) > len(TRANSPORT_PREFIX)
