"""Every command that opens a model goes through the one model reader (`tessel.models.reader`).

A broken model directory (tests/hostile_models.py: truncated or random weights, a hostile config.json,
a config claiming layers or sizes the weights do not hold) ends generate, quantize, qat, serve, launch
and profile with exit 2 and one line naming the file and the field, never a traceback, and before the
model is built. A valid GGUF file is a model for generate as for quantize.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import user_error
from typer.testing import CliRunner

import hostile_models
import tiny_models
from pipeline_plans import write_plan
from tessel.cli import app


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_models.make_tiny_checkpoint(tmp_path_factory.mktemp("reader") / "tiny", "llama", seed=5)


@pytest.fixture(scope="module")
def broken(tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    """broken(name) -> a copy of `tiny` (same directory name) with hostile_models.FINDINGS[name] applied."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            edit = hostile_models.FINDINGS[name][0]
            made[name] = hostile_models.broken_copy(tiny, tmp_path_factory.mktemp(name) / tiny.name, edit)
        return made[name]

    return get


@pytest.fixture(autouse=True)
def _no_model_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal must come before the model exists: building one fails the test."""

    def built(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a model was built for a model directory the reader should refuse")

    monkeypatch.setattr("tessel.models.loader.LlamaForCausalLM", built)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", built)


def _check(message: str, model: Path, name: str) -> None:
    _, file, field = hostile_models.FINDINGS[name]
    line = message.splitlines()[0]
    assert str(model / file) in line and field in line, message
    assert "Traceback" not in message


FINDINGS = sorted(hostile_models.FINDINGS)


@pytest.mark.parametrize("name", FINDINGS)
def test_generate_refuses_a_broken_model_in_one_line(broken, name: str) -> None:
    model = broken(name)
    _check(user_error(["generate", "--model", model, "--prompt", "hi", "--max-tokens", "1"]), model, name)


@pytest.mark.parametrize("name", FINDINGS)
def test_quantize_refuses_what_generate_refuses(broken, name: str, tmp_path: Path) -> None:
    model = broken(name)
    _check(user_error(["quantize", model, "--out", tmp_path / "out"]), model, name)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["layers-1e9", "truncated", "config-list"])
def test_every_other_command_that_opens_a_model_refuses_it(broken, name: str, tmp_path: Path, tiny) -> None:
    model = broken(name)
    text = tmp_path / "calib.txt"
    text.write_text(tiny_models.CORPUS * 4)
    plan = write_plan(
        tmp_path / "plan.json", tiny, [(0, 1), (1, 2)]
    )  # for the good model: the reader decides
    commands = [
        ["qat", model, "--out", tmp_path / "qat", "--train", text],
        ["quantize", model, "--sensitivity", tmp_path / "s.json", "--calib", text],
        ["serve", "--model", model, "--port", "1"],
        ["serve", "--model", model, "--plan", plan, "--port", "1"],
        ["launch", "--plan", plan, "--model", model, "--prompt", "hi"],
        ["profile", "--model", model, "--out", tmp_path / "p.json", "--budget-s", "1"],
    ]
    for args in commands:
        _check(user_error(args), model, name)


def test_generate_and_quantize_take_a_gguf_file_alike(tiny: Path, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("gguf")
    import tiny_gguf

    monkeypatch.undo()  # this one builds models
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = tiny_gguf.write_tiny_gguf(tiny, tmp_path / "tiny.gguf")
    runner = CliRunner()
    args = ["--prompt", "The quick brown", "--max-tokens", "6"]
    from_gguf = runner.invoke(app, ["generate", "--model", str(gguf_file), *args])
    from_dir = runner.invoke(app, ["generate", "--model", str(tiny), *args])
    assert from_gguf.exit_code == 0, from_gguf.output + repr(from_gguf.exception)
    assert from_gguf.output == from_dir.output
    out = tmp_path / "q"
    done = runner.invoke(app, ["quantize", str(gguf_file), "--out", str(out), "--scheme", "w8a16"])
    assert done.exit_code == 0, done.output + repr(done.exception)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
