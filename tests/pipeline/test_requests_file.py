"""The prompts file (`--prompts-file`, JSONL): requests round-trip, bad lines name file and line,
and hostile input never gives anything but a `TesselError`."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessel.engine.sampling_params import SamplingParams
from tessel.errors import TesselError
from tessel.pipeline.prompts_file import read_requests

DEFAULTS = SamplingParams(temperature=0.0, max_tokens=32)


def test_lines_override_the_defaults(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = ['"plain text"', json.dumps({"prompt": [5, 6, 7], "max_tokens": 3, "seed": 9}), "", "  "]
    path.write_text("\n".join(lines))
    first, second = read_requests(path, DEFAULTS)
    assert first.prompt == "plain text" and first.params == DEFAULTS
    assert second.prompt == [5, 6, 7]
    assert (second.params.max_tokens, second.params.seed, second.params.temperature) == (3, 9, 0.0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{", "not valid JSON"),
        ("[1, 2]", "expected a JSON string or an object"),
        ('{"prompt": ""}', "non-empty string"),
        ('{"prompt": [1, "a"]}', "list of token ids"),
        ('{"prompt": "x", "max_token": 3}', "unknown field(s) ['max_token']"),
        ('{"prompt": "x", "temperature": -1}', "temperature must be >= 0"),
        ('{"prompt": "x", "top_k": "many"}', "'top_k' has the wrong type"),
        ('{"prompt": "x", "max_tokens": 2.5}', "'max_tokens' has the wrong type"),
        ('{"prompt": "x", "ignore_eos": 1}', "'ignore_eos' has the wrong type"),
    ],
)
def test_bad_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "r.jsonl"
    path.write_text('"fine"\n' + line + "\n")
    with pytest.raises(TesselError) as caught:
        read_requests(path, DEFAULTS)
    assert f"{path}:2" in str(caught.value) and message in str(caught.value)


def test_empty_or_missing_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TesselError, match="holds no requests"):
        read_requests(tmp_path / "empty.jsonl", DEFAULTS)
    with pytest.raises(TesselError, match="cannot read"):
        read_requests(tmp_path / "missing.jsonl", DEFAULTS)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(
    ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"]
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(
        st.one_of(
            st.text(max_size=40),
            st.dictionaries(fields, json_values, max_size=5).map(json.dumps),
            json_values.map(json.dumps),
        ),
        max_size=5,
    )
)
def test_fuzz_only_tessel_errors(tmp_path, lines):
    path = tmp_path / "fuzz.jsonl"
    path.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    try:
        for request in read_requests(path, DEFAULTS):
            assert request.prompt
            assert isinstance(request.params, SamplingParams)
    except TesselError:
        pass


# ---- checked against the model before any stage process starts -----------------------------------
def _launch_refuses(monkeypatch, tmp_path, model, extra: list[str]):
    """`tessel launch ... extra` with spawning forbidden: -> the TesselError it exited 2 with."""
    from typer.testing import CliRunner

    from pipeline_plans import write_plan
    from tessel.cli import app
    from tessel.pipeline.supervision import launcher

    def refuse(*args, **kwargs):
        raise AssertionError("a stage process was spawned for a bad request")

    monkeypatch.setattr(launcher, "spawn_worker", refuse)
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)])
    run_dir = tmp_path / "run"
    args = ["launch", "--plan", str(plan), "--model", str(model), "--run-dir", str(run_dir), *extra]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, TesselError), result.output
    assert result.exception.exit_code == 2
    assert not list(run_dir.glob("stage*")), "a stage left files: it was started"
    return result.exception


@pytest.mark.parametrize(
    ("line", "options", "message"),
    [
        ({"prompt": [1, 5000]}, [], ":2: prompt token ids [5000] are outside the vocabulary [0, 384)"),
        ({"prompt": "x", "top_k": 2**64}, [], ":2: top_k=18446744073709551616 is larger than the vocabulary"),
        ({"prompt": "hello " * 400}, ["--max-tokens", "4"], ":2: the prompt has 1601 tokens"),
        ({"prompt": "hi", "max_tokens": 2000}, [], ":2: the prompt has 3 tokens and max_tokens is 2000"),
        (
            {"prompt": "hi"},
            ["--max-tokens", str(10**9)],
            ":1: the prompt has 3 tokens and max_tokens is 1000000000",
        ),
        ({"prompt": "hi"}, ["--max-model-len", "4096"], "max_model_len=4096 exceeds"),
    ],
)
def test_launch_refuses_bad_requests_before_any_stage(
    tiny_dirs, tmp_path, monkeypatch, line, options, message
):
    """Each used to fail in stage 0 with exit 1 once every stage had loaded."""
    path = tmp_path / "requests.jsonl"
    path.write_text('"fine"\n' + json.dumps(line) + "\n")
    error = _launch_refuses(monkeypatch, tmp_path, tiny_dirs["tied"], ["--prompts-file", str(path), *options])
    assert message in str(error)
    if message.startswith(":"):
        assert str(error).startswith(str(path) + message[:3])


def test_a_huge_line_is_refused_by_characters_before_tokenizing(tiny_dirs, tmp_path, monkeypatch):
    """A line over --max-prompt-chars (default 1,000,000) is refused without being tokenized."""
    from tessel.pipeline import checks

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("the prompt was tokenized")

    monkeypatch.setattr(checks, "load_tokenizer", no_tokenizer)
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps("a" * 1_000_001) + "\n")
    error = _launch_refuses(monkeypatch, tmp_path, tiny_dirs["tied"], ["--prompts-file", str(path)])
    assert f"{path}:1: the prompt has 1000001 characters; at most 1000000" in str(error)
    error = _launch_refuses(
        monkeypatch, tmp_path, tiny_dirs["tied"], ["--prompt", "abcdef", "--max-prompt-chars", "5"]
    )
    assert "--prompt 1: the prompt has 6 characters" in str(error)
