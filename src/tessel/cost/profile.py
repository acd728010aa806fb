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

from tessel.errors import TesselError

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


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TesselError(f"profile file {path} does not exist (make one with `tessel profile`)") from None
    except json.JSONDecodeError as error:
        raise TesselError(f"{path}: not valid JSON (line {error.lineno}: {error.msg})") from None
    if data.get("version") != PROFILE_VERSION:
        raise TesselError(f"{path}: profile version {data.get('version')!r}, expected {PROFILE_VERSION}")
    try:
        return Profile(
            device_type=str(data["device_type"]),
            model_shape={key: int(value) for key, value in data["model_shape"].items()},
            dtype=str(data["dtype"]),
            prefill=PrefillFit(**data["prefill"]),
            decode=DecodeFit(**data["decode"]),
            heldout_rel_error=float(data["heldout_rel_error"]),
            compute_efficiency=data.get("compute_efficiency"),
            memory_efficiency=data.get("memory_efficiency"),
            meta={key: str(value) for key, value in data.get("meta", {}).items()},
        )
    except (KeyError, TypeError, ValueError) as error:
        raise TesselError(f"{path}: malformed profile ({error})") from None
