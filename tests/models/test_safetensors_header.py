"""The pure-Python safetensors header reader against the `safetensors` library itself: on valid files and
on corrupted bytes (overwritten, cut, appended, a header rewritten with hostile values) it accepts
what `safe_open` opens, with the same names, dtypes and shapes, and refuses with a TesselError what
`safe_open` refuses."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from tessel.errors import TesselError
from tessel.models.safetensors_header import read_header

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int32, torch.int64, torch.uint8]
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _valid_file(path: Path, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> bytes:
    tensors = {
        f"t{i}": torch.zeros(shape, dtype=dtype)
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True))
    }
    save_file(tensors, str(path), {"format": "pt"})
    return path.read_bytes()


def _library_view(path: Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception:  # noqa: BLE001 (any refusal by the library)
        return None


def _agree(path: Path) -> None:
    library = _library_view(path)
    try:
        ours = {n: (t.dtype, t.shape) for n, t in read_header(path).items()}
    except TesselError as error:
        assert "\n" not in str(error) and str(path) in str(error)
        assert library is None or "tessel does not read" in str(error), (library, str(error))
        return
    assert library is not None and ours == library


SHAPES = st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), min_size=0, max_size=4)


@FUZZ
@given(shapes=SHAPES, data=st.data())
def test_valid_files_read_as_the_library_reads_them(tmp_path: Path, shapes, data) -> None:
    dtypes = [data.draw(st.sampled_from(DTYPES)) for _ in shapes]
    path = tmp_path / "w.safetensors"
    _valid_file(path, shapes, dtypes)
    assert len(read_header(path)) == len(shapes)
    _agree(path)


@FUZZ
@given(data=st.data())
def test_corrupted_bytes_are_refused_as_the_library_refuses_them(tmp_path: Path, data) -> None:
    path = tmp_path / "w.safetensors"
    raw = bytearray(_valid_file(path, [(3, 4), (2,), (5,)], [torch.float32, torch.int8, torch.bfloat16]))
    (header_bytes,) = struct.unpack("<Q", raw[:8])
    how = data.draw(st.sampled_from(["overwrite", "cut", "append"]))
    if how == "overwrite":  # mostly in the length and header, where the checks are
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, min(len(raw), 8 + header_bytes) - 1))
            raw[at] = data.draw(st.integers(0, 255))
    elif how == "cut":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=16))
    path.write_bytes(bytes(raw))
    _agree(path)


HOSTILE_NUMBERS = st.one_of(
    st.integers(-3, 200), st.sampled_from([2**63, 2**64, 2**64 + 1, 10**30]), st.floats(), st.text(max_size=3)
)


@FUZZ
@given(data=st.data())
def test_rewritten_headers_are_refused_as_the_library_refuses_them(tmp_path: Path, data) -> None:
    path = tmp_path / "w.safetensors"
    raw = _valid_file(path, [(3, 4), (2,)], [torch.float32, torch.int8])
    (header_bytes,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8 : 8 + header_bytes]), raw[8 + header_bytes :]
    name = data.draw(st.sampled_from(["t0", "t1", "__metadata__"]))
    key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "format"]))
    value = data.draw(
        st.one_of(
            HOSTILE_NUMBERS,
            st.lists(HOSTILE_NUMBERS, max_size=3),
            st.sampled_from(["F32", "I8", "BF16", "F64", "F4", "C64", "bogus", None]),
        )
    )
    header[name] = (
        dict(header.get(name) or {}) | {key: value} if not isinstance(header.get(name), str) else value
    )
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)
    _agree(path)


@pytest.mark.parametrize(
    "header, body, message",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 9, "cover 8 bytes of the 9"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "overlap or leave a gap"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12"),
        ({"a": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "tessel does not read"),
        ({"__metadata__": {"format": 1}}, b"", "__metadata__ is not an object of strings"),
        ([1, 2], b"", "not a JSON object"),
        ({"a": {"dtype": "F32", "shape": ["-0"], "data_offsets": [0, 0]}}, b"", "no valid shape"),
    ],
)
def test_hand_made_headers_say_what_is_wrong(tmp_path: Path, header, body: bytes, message: str) -> None:
    encoded = json.dumps(header).encode().replace(b'"-0"', b"-0")  # JSON's -0, which json.dumps never writes
    path = tmp_path / "w.safetensors"
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)
    with pytest.raises(TesselError, match=message):
        read_header(path)
    assert _library_view(path) is None or "Q9" in encoded.decode()
