"""Long steps report progress on stderr (plain lines when stderr is not a terminal); stdout keeps only
the result."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tiny_models
from tessel.cli import app
from tessel.commands.progress import LINE_STEPS, step_progress

LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.make_tiny_checkpoint(tmp_path_factory.mktemp("progress") / "tiny", "llama", seed=4)


def _steps(stderr: str) -> dict[str, list[tuple[int, int]]]:
    found: dict[str, list[tuple[int, int]]] = {}
    for label, done, total in re.findall(r"^(\w+) (\d+)/(\d+) \(\d+ s\)$", stderr, re.MULTILINE):
        found.setdefault(label, []).append((int(done), int(total)))
    return found


def test_plain_lines_at_most_every_tenth(capsys: pytest.CaptureFixture) -> None:
    with step_progress(terminal=False) as progress:
        for done in range(1, 1001):
            progress("steps", done, 1000)
    lines = _steps(capsys.readouterr().err)["steps"]
    assert lines[-1] == (1000, 1000) and len(lines) <= LINE_STEPS + 1
    assert [done for done, _ in lines] == sorted(done for done, _ in lines)


def test_quantize_reports_load_each_linear_and_write(tiny: Path, tmp_path: Path) -> None:
    args = ["quantize", str(tiny), "--out", str(tmp_path / "q"), "--scheme", "w8a16"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    steps = _steps(result.stderr)
    linears = LINEARS_PER_LAYER * json.loads((tiny / "config.json").read_text())["num_hidden_layers"]
    assert steps["load"][0] == (0, 1) and steps["load"][-1] == (1, 1)
    assert steps["weights"][-1] == (linears, linears) and len(steps["weights"]) <= LINE_STEPS + 1
    assert steps["write"][-1] == (1, 1)
    assert not _steps(result.stdout) and result.stdout.startswith(f"w8a16: {linears} linears quantised")


def test_qat_reports_each_step(tiny: Path, tmp_path: Path) -> None:
    text = tmp_path / "train.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    args = ["qat", "--model", tiny, "--out", tmp_path / "q", "--train", text, "--steps", "3"]
    args += ["--seq-len", "16", "--group-size", "32"]
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert _steps(result.stderr)["qat"] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert not _steps(result.stdout) and result.stdout.startswith("w4a16: loss")
