"""The header of a .safetensors file, read and checked without loading a tensor (pure Python).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (tensor name ->
dtype, shape, data_offsets; an optional `__metadata__` object of strings), then the data. The
checks are the ones the `safetensors` library makes when it opens a file (its header limit, offsets
that tile the data with no gap or overlap, each tensor's byte count from its dtype and shape, the
data ending where the file ends), so a header read here opens there, and a truncated, random or
hostile file is a TesselError naming the file before anything is allocated.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from tessel.errors import TesselError

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit (MAX_HEADER_SIZE)
LENGTH_BYTES = 8  # the little-endian u64 header length in front of the header
SAFETENSORS_DTYPE_BYTES = {  # the byte-sized safetensors dtypes tessel reads (sub-byte F4/F6 and complex: no)
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
SAFETENSORS_FLOAT_DTYPES = frozenset(
    {"F16", "BF16", "F32", "F64"}
)  # what a float weight or a scale may be stored as
METADATA_KEY = "__metadata__"


@dataclass(frozen=True, slots=True)
class TensorHeader:
    """One tensor's entry: its safetensors dtype name (F32, BF16, I8, ...), shape and file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path

    @property
    def is_float(self) -> bool:
        return self.dtype in SAFETENSORS_FLOAT_DTYPES

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * SAFETENSORS_DTYPE_BYTES[self.dtype]


def read_header(file: Path) -> dict[str, TensorHeader]:
    """The tensors of `file` by name, checked against the file's length."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            prefix = f.read(LENGTH_BYTES)
            header_bytes = _header_length(file, prefix, size)
            raw = f.read(header_bytes)
    except OSError as error:
        raise TesselError(f"{file}: cannot read ({error.strerror or error})") from None
    entries = _parse(file, raw)
    data_bytes = size - LENGTH_BYTES - header_bytes
    tensors = {name: _tensor(file, name, entry) for name, entry in entries.items()}
    _check_offsets(file, entries, tensors, data_bytes)
    return tensors


def _broken(file: Path, what: str) -> TesselError:
    return TesselError(
        f"{file}: not a readable safetensors file ({what}); it may be truncated or corrupt, re-download it"
    )


def _header_length(file: Path, prefix: bytes, size: int) -> int:
    if len(prefix) < LENGTH_BYTES:
        raise _broken(file, f"{size} bytes, shorter than the {LENGTH_BYTES}-byte header length")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise _broken(file, f"a header of {length} bytes, above the format's {MAX_HEADER_BYTES}")
    if LENGTH_BYTES + length > size:
        raise _broken(file, f"a header of {length} bytes in a file of {size}")
    return length


def _parse(file: Path, raw: bytes) -> dict[str, dict]:
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant, parse_int=_parse_int)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _broken(file, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _broken(file, "its header is not a JSON object")
    metadata = header.pop(METADATA_KEY, None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise _broken(file, f"{METADATA_KEY} is not an object of strings")
    for name, entry in header.items():
        if not isinstance(entry, dict):
            raise _broken(file, f"the entry of tensor {name!r} is not an object")
    return header


def _refuse_constant(name: str) -> None:
    """NaN and Infinity are Python's JSON, not JSON: the library's parser refuses them."""
    raise ValueError(f"{name} is not JSON")


def _parse_int(text: str) -> int:
    """A JSON integer; every negative one (`-0` too, which Python reads as 0) is -1, which no field takes."""
    return -1 if text.startswith("-") else int(text)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


def _tensor(file: Path, name: str, entry: dict) -> TensorHeader:
    dtype, shape = entry.get("dtype"), entry.get("shape")
    if not isinstance(dtype, str):
        raise _broken(file, f"tensor {name!r} has no dtype name")
    if dtype not in SAFETENSORS_DTYPE_BYTES:
        raise TesselError(
            f"{file}: tensor {name!r} has dtype {str(dtype)[:40]!r}, which tessel does not read "
            f"({', '.join(SAFETENSORS_DTYPE_BYTES)})"
        )
    if not (isinstance(shape, list) and len(shape) <= 8 and all(_whole(d) for d in shape)):
        raise _broken(file, f"tensor {name!r} has no valid shape")
    return TensorHeader(name, dtype, tuple(shape), file)


def _check_offsets(
    file: Path, entries: dict[str, dict], tensors: dict[str, TensorHeader], data_bytes: int
) -> None:
    """Offsets tile [0, data_bytes) in order, each span the tensor's size (as safetensors checks)."""
    spans = []
    for name, entry in entries.items():
        offsets = entry.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) for o in offsets)):
            raise _broken(file, f"tensor {name!r} has no valid data_offsets")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end or stop < begin:
            raise _broken(file, f"tensor {name!r} has data_offsets that overlap or leave a gap")
        if stop - begin != tensors[name].num_bytes:
            raise _broken(
                file,
                f"tensor {name!r} holds {stop - begin} bytes, its {tensors[name].dtype} shape "
                f"{list(tensors[name].shape)} needs {tensors[name].num_bytes}",
            )
        end = stop
    if end != data_bytes:
        raise _broken(file, f"the tensors cover {end} bytes of the {data_bytes} after the header")
