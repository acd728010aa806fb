"""Measured per-layer timings that replace the analytic roofline for one device type.

`tessel profile` times one real decoder layer over a grid and fits, per layer,

    prefill:  t(c, p) = a0 + a1*c + a2*p + a3*c*(p + c/2)          (c chunk tokens at offset p)
    decode:   t(B, S) = b0 + b1*B + b2*S                             (B sequences, S = sum of contexts)

and writes them as JSON (`PROFILE_VERSION`). The cost model uses a profile for the device type
and model shape it was measured on; for another model shape it falls back to the efficiencies
the fit implies (`compute_efficiency`, `memory_efficiency`), or to the catalog defaults.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tessel.catalog.yaml_reader import validate_data
from tessel.errors import TesselError
from tessel.files import read_json_file

PROFILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class PrefillFit:
    a0: float
    a1: float
    a2: float
    a3: float

    def time_s(self, chunk_tokens: float, offset_tokens: float) -> float:
        c, p = chunk_tokens, offset_tokens
        return self.a0 + self.a1 * c + self.a2 * p + self.a3 * c * (p + c / 2)


@dataclass(frozen=True, slots=True)
class DecodeFit:
    b0: float
    b1: float
    b2: float

    def time_s(self, batch_size: float, sum_context_tokens: float) -> float:
        return self.b0 + self.b1 * batch_size + self.b2 * sum_context_tokens


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

    def matches(self, device_type: str, model_shape: dict[str, int]) -> bool:
        return self.device_type == device_type and all(
            self.model_shape.get(key) == value for key, value in model_shape.items()
        )

    def to_json(self) -> dict:
        return {"version": PROFILE_VERSION, **asdict(self)}

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


def load_profile(path: str | Path) -> Profile:
    """A profile written by `tessel profile`; a broken file raises `TesselError` naming the field."""
    path = Path(path)
    if not path.exists():
        raise TesselError(f"profile file {path} does not exist (make one with `tessel profile`)")
    data = read_json_file(path, "profile file")
    if not isinstance(data, dict):
        raise TesselError(f"{path}: a profile file holds a JSON object")
    if data.get("version") != PROFILE_VERSION:
        raise TesselError(f"{path}: profile version {data.get('version')!r:.40}, expected {PROFILE_VERSION}")
    model = validate_data(data, str(path), _ProfileModel)
    return Profile(
        device_type=model.device_type,
        model_shape=dict(model.model_shape),
        dtype=model.dtype,
        prefill=PrefillFit(**model.prefill.model_dump()),
        decode=DecodeFit(**model.decode.model_dump()),
        heldout_rel_error=model.heldout_rel_error,
        compute_efficiency=model.compute_efficiency,
        memory_efficiency=model.memory_efficiency,
        meta={key: str(value) for key, value in model.meta.items()},
    )
