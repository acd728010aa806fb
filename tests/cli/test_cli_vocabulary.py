"""One CLI vocabulary: `--json` for JSON outputs (`profile --out` a hidden alias), MODEL as the first
argument or `--model` in quantize and qat, and every option with help text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer.main
from cli_helpers import user_error
from typer.testing import CliRunner

import tiny_models
from tessel.cli import app

PROFILE = ["profile", "--tiny-shape", "64,128,4,2", "--budget-s", "0.3"]
PROFILE += ["--max-chunk", "64", "--max-offset", "64"]


def _words(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.make_tiny_checkpoint(tmp_path_factory.mktemp("vocab") / "tiny", "llama", seed=3)


@pytest.mark.parametrize("option", ["--json", "--out"])
def test_profile_writes_its_json_with_json_and_the_old_out(option: str, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, [*PROFILE, option, str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert set(json.loads(out.read_text())) >= {"prefill", "decode"}
    assert ("is now --json" in result.output) == (option == "--out")


def test_profile_help_shows_json_not_the_deprecated_out() -> None:
    text = CliRunner().invoke(app, ["profile", "--help"]).output
    assert "--json" in text and "--out" not in text


def test_profile_refuses_json_and_out_naming_two_files(tmp_path: Path) -> None:
    message = user_error([*PROFILE, "--json", tmp_path / "a.json", "--out", tmp_path / "b.json"])
    assert "two files" in message and not (tmp_path / "a.json").exists()


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_quantize_takes_model_as_the_argument_or_as_model(tiny: Path, tmp_path: Path) -> None:
    runner, args = CliRunner(), ["--scheme", "w8a16"]
    positional = runner.invoke(app, ["quantize", str(tiny), "--out", str(tmp_path / "a"), *args])
    option = runner.invoke(app, ["quantize", "--model", str(tiny), "--out", str(tmp_path / "b"), *args])
    assert positional.exit_code == option.exit_code == 0, option.output + repr(option.exception)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    both = ["quantize", str(tiny), "--model", str(tiny), "--out", str(tmp_path / "c"), *args]
    same = runner.invoke(app, both)
    assert same.exit_code == 0 and _files(tmp_path / "c") == _files(tmp_path / "a")


@pytest.mark.parametrize("command", ["quantize", "qat"])
def test_model_twice_or_never_is_a_clear_error(command: str, tiny: Path, tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 50)
    rest = ["--out", tmp_path / "o"] + (["--train", text] if command == "qat" else [])
    assert "give the model" in user_error([command, *rest])
    message = user_error([command, tiny, "--model", tmp_path, *rest])
    assert "two models given" in message and str(tmp_path) in message
    assert not (tmp_path / "o").exists()


def test_model_is_named_the_same_in_every_command_that_loads_one() -> None:
    for name, command in typer.main.get_command(app).commands.items():
        if name in ("quantize", "qat", "generate", "serve", "launch", "embed", "profile"):
            assert any("--model" in param.opts for param in command.params), name
