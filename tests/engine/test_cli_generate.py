"""`tessel generate` end to end on a tiny checkpoint."""

from __future__ import annotations

from typer.testing import CliRunner

from tessel import LLM, SamplingParams
from tessel.cli import app


def test_generate_prints_the_greedy_completions(checkpoints) -> None:
    path = checkpoints("llama")
    args = ["generate", "--model", str(path), "--prompt", "Hello world", "--prompt", "Once upon"]
    result = CliRunner().invoke(app, [*args, "--max-tokens", "6", "--ignore-eos"])
    assert result.exit_code == 0, result.output
    expected = LLM(path).generate(
        ["Hello world", "Once upon"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    for out in expected:
        assert out.text.strip() in result.output
    assert result.output.count("finish_reason=length") == 2


def test_generate_with_a_missing_model_is_a_user_error(tmp_path) -> None:
    result = CliRunner().invoke(app, ["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"])
    assert result.exit_code != 0
    assert "not a directory" in str(result.exception) + result.output
