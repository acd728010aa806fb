"""Quality cost of each layer at each weight precision: the per-layer indicator the planner bounds.

The cost of a layer at precision q is the relative variance that rounding its weights to q adds to
its outputs, summed over its linear maps with each map's share of the layer's matmul parameters,
minus the same at the reference precision (so the reference costs 0). A plan's cost is the sum
over layers: LLM-PQ (Zhao et al., PPoPP 2024) also adds its per-layer variance indicators, treating
the rounding noise of different layers as independent. LLM-PQ's indicator for a linear map is the
output variance d_in * Var(rounding error) * E[x^2]; with inputs normalised (E[x^2] = 1 after the
layer's norm) and divided by the output's own variance d_in * E[w^2], it is the ratio used here.

Three sources, in the order `quality_costs` takes them:

- a measured sensitivity file (`--sensitivity FILE`, JSON, `SensitivityFile`): per layer, per
  precision, any non-negative cost (e.g. the perplexity increase when that one layer is quantised);
  refused when written for another model (name or layer count);
- a local checkpoint (the model given as a directory with *.safetensors): each layer's weights are
  rounded at each precision (symmetric, per output channel for int8, groups of 128 for int4, a
  shorter last group where 128 does not divide a row) and the
  measured relative error ||W - Q(W)||^2 / ||W||^2 is the ratio above; at most `SAMPLE_ROWS` rows
  per matrix, evenly spaced, keep this fast on 70B checkpoints;
- otherwise, from the model's shape alone (`shape_costs`, the default): weights taken as
  Gaussian, a row of n weights has max |w| about sigma * sqrt(2 ln 2n), an integer grid of b bits
  has step 2 max|w| / (2^b - 1) and uniform rounding error of variance step^2 / 12, so the ratio is
  (2/3) ln(2n) / (2^b - 1)^2 (n = the row length, or the group size for int4); a float format with
  m mantissa bits has relative rounding variance 2^(-2m) / 12. Layers of one shape get one cost.

At `sublayer` granularity a layer's cost splits between its attention and MLP units by what each
one's own maps contribute.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tessel.catalog.models import ModelSpec
from tessel.cost import layer as L
from tessel.errors import TesselError

MANTISSA_BITS = {"fp32": 23, "fp16": 10, "bf16": 7}
INTEGER_BITS = {"int8": 8, "int4": 4}
SAMPLE_ROWS = 256  # rows per weight matrix read from a checkpoint
MAX_SENSITIVITY_BYTES = 16 * 2**20


class SensitivityFile(BaseModel):
    """`--sensitivity FILE`: {"model": NAME, "num_layers": L, "costs": {"int8": [L numbers], ...}}."""

    model_config = ConfigDict(extra="forbid")
    model: str
    num_layers: int = Field(gt=0)
    costs: dict[str, list[float]]


def _float_ratio(name: str) -> float:
    return 2.0 ** (-2 * MANTISSA_BITS[name]) / 12.0


def _integer_ratio(bits: int, row: int) -> float:
    return (2.0 / 3.0) * math.log(2 * row) / (2**bits - 1) ** 2


def _ratio(name: str, row: int) -> float:
    """Relative rounding variance of a Gaussian row of `row` weights at precision `name`."""
    if name in MANTISSA_BITS:
        return _float_ratio(name)
    if name == "int4":
        row = min(row, L.INT4_GROUP_SIZE)
    return _integer_ratio(INTEGER_BITS[name], row)


def _maps(model: ModelSpec) -> dict[str, list[tuple[int, int]]]:
    """(parameters, row length) of each linear map of an attention and an MLP block."""
    h, a, g, d, f = L.block_dims(model)
    attention = [(h * a * d, h), (2 * h * g * d, h), (a * d * h, a * d)]
    up = 2 if model.mlp_kind == "gated" else 1
    mlp = [(up * h * f * model.num_experts, h), (f * h * model.num_experts, f)]
    return {"attention": attention, "mlp": mlp}


def shape_costs(model: ModelSpec, precisions: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Per kind ("attention", "mlp"), the cost at each precision (reference = precisions[0]) [P]."""
    maps = _maps(model)
    total = sum(p for kind in maps.values() for p, _ in kind)
    out = {}
    for kind, kind_maps in maps.items():
        ratios = np.array([sum(p * _ratio(name, row) for p, row in kind_maps) / total for name in precisions])
        out[kind] = np.maximum(ratios - ratios[0], 0.0)
    return out


def unit_costs(per_layer: dict[str, np.ndarray], kinds: tuple[str, ...], num_layers: int) -> np.ndarray:
    """[U, P] costs of the units in model order from per-kind costs per layer ({kind: [layers, P]})."""
    if kinds == ("layer",):
        return per_layer["attention"] + per_layer["mlp"]
    return np.stack([per_layer[kind] for kind in kinds], axis=1).reshape(num_layers * len(kinds), -1)


def quality_costs(
    model: ModelSpec,
    precisions: tuple[str, ...],
    kinds: tuple[str, ...],
    *,
    checkpoint: Path | None = None,
    sensitivity: Path | None = None,
) -> tuple[np.ndarray, str]:
    """[U, P] quality costs and where they came from ("sensitivity", "weights" or "shape")."""
    n = model.num_layers
    if sensitivity is not None:
        per_layer = _from_sensitivity(model, precisions, sensitivity)
        return unit_costs(per_layer, kinds, n), "sensitivity"
    if checkpoint is not None and any(checkpoint.glob("*.safetensors")):
        return unit_costs(weight_costs(model, precisions, checkpoint), kinds, n), "weights"
    per_kind = shape_costs(model, precisions)
    per_layer = {kind: np.tile(costs, (n, 1)) for kind, costs in per_kind.items()}
    return unit_costs(per_layer, kinds, n), "shape"


def _from_sensitivity(model: ModelSpec, precisions: tuple[str, ...], path: Path) -> dict[str, np.ndarray]:
    """Per-layer costs from a sensitivity file, split between attention and MLP by the shape costs."""
    try:
        if path.stat().st_size > MAX_SENSITIVITY_BYTES:
            raise TesselError(f"--sensitivity {path}: larger than {MAX_SENSITIVITY_BYTES >> 20} MiB")
        data = SensitivityFile.model_validate_json(path.read_bytes())
    except OSError as error:
        raise TesselError(f"--sensitivity {path}: {error.strerror}") from None
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "file"
        raise TesselError(f"--sensitivity {path}: {where}: {first['msg']}") from None
    if data.model.lower() != model.name.lower() or data.num_layers != model.num_layers:
        raise TesselError(
            f"--sensitivity {path} was measured on {data.model} ({data.num_layers} layers), not on "
            f"{model.name} ({model.num_layers} layers); measure it on this model"
        )
    layers = np.zeros((model.num_layers, len(precisions)))
    for q, name in enumerate(precisions[1:], start=1):
        values = data.costs.get(name)
        if values is None:
            raise TesselError(f"--sensitivity {path}: no costs for {name}; it has {', '.join(data.costs)}")
        if len(values) != model.num_layers or not all(math.isfinite(v) and v >= 0 for v in values):
            raise TesselError(
                f"--sensitivity {path}: costs.{name} needs {model.num_layers} finite numbers >= 0"
            )
        layers[:, q] = values
    share = shape_costs(model, precisions)
    total = share["attention"] + share["mlp"]
    with np.errstate(invalid="ignore", divide="ignore"):
        attention_share = np.where(total > 0, share["attention"] / total, 0.5)
    return {"attention": layers * attention_share, "mlp": layers * (1 - attention_share)}


# ---- from a checkpoint's weights --------------------------------------------------------------

_SAFETENSORS_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}


def _tensors(path: Path):
    """(name, float32 sampled rows, row count) of each 2-D tensor of a .safetensors file (numpy only)."""
    with path.open("rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
        base = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__" or len(info.get("shape", ())) != 2:
                continue
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                continue
            rows, cols = info["shape"]
            keep = np.unique(np.linspace(0, rows - 1, min(rows, SAMPLE_ROWS)).astype(int))
            item = np.dtype(dtype).itemsize
            start = info["data_offsets"][0]
            out = np.empty((len(keep), cols), dtype=np.float32)
            for i, row in enumerate(keep):
                handle.seek(base + start + int(row) * cols * item)
                raw = np.frombuffer(handle.read(cols * item), dtype=dtype)
                out[i] = (raw.astype(np.uint32) << 16).view(np.float32) if info["dtype"] == "BF16" else raw
            yield name, out, rows


def relative_error(weights: np.ndarray, name: str) -> float:
    """||W - Q(W)||^2 / ||W||^2 for symmetric rounding to `name` (rows = output channels)."""
    w = weights.astype(np.float64)
    norm = float(np.sum(w * w))
    if norm == 0.0:
        return 0.0
    if name in MANTISSA_BITS:
        cast = {"fp32": np.float32, "fp16": np.float16}.get(name)
        if cast is not None:
            rounded = w.astype(cast).astype(np.float64)
        else:  # bf16: keep the top 16 bits of the float32 pattern, rounding to nearest even
            bits = w.astype(np.float32).view(np.uint32)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            rounded = bits.astype(np.uint32).view(np.float32).astype(np.float64)
        return float(np.sum((w - rounded) ** 2)) / norm
    bits = INTEGER_BITS[name]
    group = min(L.INT4_GROUP_SIZE, w.shape[1]) if name == "int4" else w.shape[1]
    # a row that 128 does not divide ends in a shorter group: zero padding adds no error and leaves
    # that group's max |w| (its scale) as the real weights set it
    padded = np.pad(w, ((0, 0), (0, -w.shape[1] % group)))
    grouped = padded.reshape(w.shape[0], -1, group)
    levels = 2 ** (bits - 1) - 1
    scale = np.abs(grouped).max(axis=2, keepdims=True) / levels
    scale[scale == 0] = 1.0
    rounded = np.clip(np.round(grouped / scale), -levels - 1, levels) * scale
    return float(np.sum((grouped - rounded) ** 2)) / norm


def weight_costs(model: ModelSpec, precisions: tuple[str, ...], checkpoint: Path) -> dict[str, np.ndarray]:
    """Per kind, [layers, P] costs measured on the checkpoint's weights (see the module docstring)."""
    import re

    pattern = re.compile(r"layers\.(\d+)\.")
    params = {kind: np.zeros(model.num_layers) for kind in ("attention", "mlp")}
    errors = {kind: np.zeros((model.num_layers, len(precisions))) for kind in ("attention", "mlp")}
    for path in sorted(checkpoint.glob("*.safetensors")):
        for name, weights, rows in _tensors(path):
            match = pattern.search(name)
            if match is None or not name.endswith(".weight") or "norm" in name:
                continue
            layer = int(match.group(1))
            if layer >= model.num_layers:
                raise TesselError(
                    f"{checkpoint}: has layer {layer}, but {model.name} has {model.num_layers} layers"
                )
            kind = "attention" if "attn" in name else "mlp"
            full = weights.shape[1] * rows
            params[kind][layer] += full
            errors[kind][layer] += full * np.array([relative_error(weights, q) for q in precisions])
    total = params["attention"] + params["mlp"]
    if np.any(total == 0):
        missing = int(np.flatnonzero(total == 0)[0])
        raise TesselError(f"{checkpoint}: no weights found for layer {missing} of {model.name}")
    return {kind: np.maximum((errors[kind] - errors[kind][:, :1]) / total[:, None], 0.0) for kind in errors}
