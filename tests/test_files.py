"""`tessel.files.write_json_file`: atomic (a failed write keeps the previous file), umask-respecting."""

from __future__ import annotations

import json
import os

import pytest

import tessel.files
from tessel.errors import TesselError
from tessel.files import write_json_file


def test_write_replaces_the_file_and_respects_the_umask(tmp_path) -> None:
    path = tmp_path / "new" / "out.json"
    write_json_file(path, {"a": 1.5, "b": float("inf")})
    write_json_file(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]


def test_an_interrupted_write_keeps_the_previous_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "out.json"
    write_json_file(path, {"kept": True})

    def fail(*_args) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tessel.files.os, "replace", fail)
    with pytest.raises(TesselError, match="No space left"):
        write_json_file(path, {"kept": False}, "--json")
    assert json.loads(path.read_text()) == {"kept": True}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]
