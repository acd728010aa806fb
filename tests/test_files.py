"""`tessel.files` writers: atomic (a failed write keeps the previous file), umask-respecting, and never
removing what tessel did not write (issue 27: output directories are staged and marked)."""

from __future__ import annotations

import json
import os

import pytest

import tessel.files
from tessel.errors import TesselError
from tessel.files import (
    OUTPUT_MARKER,
    check_output_directory,
    claim_directory,
    read_nonempty_text_file,
    staged_directory,
    staged_file,
    write_json_file,
)


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


# ---- output directories: never remove what tessel did not write (issue 27) -------------------------


def _tree(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _mine(folder):
    folder.mkdir(parents=True)
    (folder / "data.txt").write_text("the user's")
    return folder


def test_staged_directory_builds_beside_the_target_and_marks_it(tmp_path) -> None:
    out = tmp_path / "a" / "out"
    with staged_directory(out) as staging:
        assert staging.parent == out.parent and staging.name.startswith(".out.partial-")
        assert not out.exists()
        (staging / "w.bin").write_bytes(b"1")
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "w.bin"]
    assert [p.name for p in out.parent.iterdir()] == ["out"]
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask


def test_overwrite_replaces_only_a_marked_directory(tmp_path) -> None:
    out = tmp_path / "out"
    with staged_directory(out) as staging:
        (staging / "old.bin").write_bytes(b"old")
    with pytest.raises(TesselError, match="already exists; pass --overwrite"):
        with staged_directory(out):
            pytest.fail("the block must not run")
    with staged_directory(out, overwrite=True) as staging:
        (staging / "new.bin").write_bytes(b"new")
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "new.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    other = _mine(tmp_path / "other")
    with pytest.raises(TesselError, match=f"not written by tessel .*{OUTPUT_MARKER}"):
        with staged_directory(other, overwrite=True):
            pytest.fail("the block must not run")
    assert _tree(other) == {"data.txt": b"the user's"}


def test_a_failed_block_keeps_the_old_output_and_removes_its_staging(tmp_path) -> None:
    out = tmp_path / "out"
    with staged_directory(out) as staging:
        (staging / "w.bin").write_bytes(b"old")
    before = _tree(out)
    for error in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            with staged_directory(out, overwrite=True) as staging:
                (staging / "w.bin").write_bytes(b"half")
                raise error
        assert _tree(out) == before and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_failed_move_puts_the_old_output_back(tmp_path, monkeypatch) -> None:
    out = tmp_path / "out"
    with staged_directory(out) as staging:
        (staging / "w.bin").write_bytes(b"old")
    before = _tree(out)
    real_rename, calls = os.rename, []

    def rename(source, destination) -> None:
        calls.append(source)
        if len(calls) == 2:  # the new directory into place (the first call moved the old one aside)
            raise OSError(28, "No space left on device")
        real_rename(source, destination)

    monkeypatch.setattr(tessel.files.os, "rename", rename)
    with pytest.raises(TesselError, match="No space left"):
        with staged_directory(out, overwrite=True) as staging:
            (staging / "w.bin").write_bytes(b"new")
    assert _tree(out) == before and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_target_that_appears_during_the_run_is_not_replaced(tmp_path) -> None:
    out = tmp_path / "out"
    with pytest.raises(TesselError, match="already exists"):
        with staged_directory(out) as staging:
            (staging / "w.bin").write_bytes(b"new")
            _mine(out)  # another program writes there meanwhile
    assert _tree(out) == {"data.txt": b"the user's"} and [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize(
    "case,message",
    [
        ("input", "is an input of this command"),
        ("input-parent", "holds an input of this command"),
        ("cwd", "is the current directory"),
        ("cwd-parent", "holds the current directory"),
        ("home", "is your home directory"),
        ("root", "is the root directory"),
        ("file", "is not a directory"),
        ("symlink", "symbolic link"),
        ("under-a-file", "is a file, not a folder"),
    ],
)
def test_check_output_directory_refuses(tmp_path, monkeypatch, case, message) -> None:
    model = _mine(tmp_path / "models" / "m")
    work = _mine(tmp_path / "w" / "work")
    home = _mine(tmp_path / "h" / "home")
    for folder in (model, model.parent, work, home):
        (folder / OUTPUT_MARKER).write_text("tessel")  # marked, and overwrite: still refused
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(model.parent / "elsewhere", target_is_directory=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    target = {
        "input": model,
        "input-parent": model.parent,
        "cwd": ".",
        "cwd-parent": "..",
        "home": "~",
        "root": "/",
        "file": tmp_path / "file",
        "symlink": tmp_path / "link",
        "under-a-file": tmp_path / "file" / "out",
    }[case]
    before = _tree(tmp_path)
    with pytest.raises(TesselError, match=message):
        check_output_directory(target, "--out", inputs=(model, None, "bundled-name"), overwrite=True)
    assert _tree(tmp_path) == before


def test_check_output_directory_accepts_new_empty_and_marked_directories(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    marked = _mine(tmp_path / "marked")
    (marked / OUTPUT_MARKER).write_text("tessel")
    assert check_output_directory(tmp_path / "new" / "deeper", "--out") == tmp_path / "new" / "deeper"
    assert check_output_directory(tmp_path / "empty", "--out") == tmp_path / "empty"
    assert check_output_directory(marked, "--out", overwrite=True) == marked
    assert check_output_directory(tmp_path / "models" / "m" / "q", "--out", inputs=[tmp_path / "models"])


def test_claim_directory_marks_a_new_folder_and_refuses_a_users(tmp_path) -> None:
    run = claim_directory(tmp_path / "run", "--run-dir")
    assert [p.name for p in run.iterdir()] == [OUTPUT_MARKER]
    (run / "stage0.log").write_text("log")
    assert claim_directory(run, "--run-dir") == run  # tessel's own: reused
    mine = _mine(tmp_path / "mine")
    with pytest.raises(TesselError, match="did not write"):
        claim_directory(mine, "--run-dir")
    assert _tree(mine) == {"data.txt": b"the user's"}


# ---- output files: never over one of the command's own inputs ------------------------------------


def test_a_file_output_is_never_an_input(tmp_path) -> None:
    source = tmp_path / "cluster.yaml"
    source.write_text("name: x\n")
    (tmp_path / "hard.yaml").hardlink_to(source)
    (tmp_path / "soft.yaml").symlink_to(source)
    for same in (
        source,
        tmp_path / "hard.yaml",
        tmp_path / "soft.yaml",
        tmp_path / "sub" / ".." / "cluster.yaml",
    ):
        with pytest.raises(TesselError, match="is also an input of this command"):
            write_json_file(same, {"a": 1}, "--json", inputs=("bundled", source))
    assert source.read_text() == "name: x\n"
    write_json_file(tmp_path / "plan.json", {"a": 1}, "--json", inputs=("bundled", source))


def test_staged_file_keeps_the_suffix_and_cleans_up(tmp_path) -> None:
    path = tmp_path / "chart.svg"
    with staged_file(path, "--gantt") as staging:
        assert staging.suffix == ".svg" and staging.parent == tmp_path
        staging.write_text("<svg/>")
    assert path.read_text() == "<svg/>"
    with pytest.raises(RuntimeError):
        with staged_file(path, "--gantt") as staging:
            staging.write_text("half")
            raise RuntimeError("the plot failed")
    assert path.read_text() == "<svg/>" and [p.name for p in tmp_path.iterdir()] == ["chart.svg"]


@pytest.mark.parametrize("content", [b"", b" \n\t", bytes(range(256)), b"\xff\xfe"])
def test_read_nonempty_text_file_refuses_blank_and_binary(tmp_path, content) -> None:
    path = tmp_path / "calib.txt"
    path.write_bytes(content)
    with pytest.raises(TesselError, match=r"--calib .*calib\.txt"):
        read_nonempty_text_file(path, "--calib")
    path.write_text("some text")
    assert read_nonempty_text_file(path, "--calib") == "some text"
