"""benchmarks/_harness.py: one record per run appended to one file per benchmark, the timer's runs,
and every benchmark script going through it."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("_harness", BENCHMARKS / "_harness.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["_harness"] = module  # as `import _harness` in a benchmark (its dataclasses need it)
    spec.loader.exec_module(module)
    yield module
    del sys.modules["_harness"]


def test_each_run_appends_one_record_and_keeps_the_earlier_ones(harness, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(harness.GIT_SHA_ENV, "f" * 40)
    out = tmp_path / "results" / "demo.jsonl"
    harness.append_record(out, "demo", {"tok_s": 1.5, "bad": math.nan}, "first")
    before = out.read_text()
    harness.append_record(out, "demo", {"tok_s": 2.5, "where": tmp_path}, "second")
    assert out.read_text().startswith(before)
    first, second = harness.read_records(out)
    assert [first["label"], second["label"]] == ["first", "second"]
    assert first["result"] == {"tok_s": 1.5, "bad": None}  # valid JSON: no NaN
    assert second["result"]["where"] == str(tmp_path)
    for record in (first, second):
        assert record["benchmark"] == "demo" and record["git_sha"] == "f" * 40
        assert {"time_utc", "command", "machine"} <= record.keys()
        assert record["machine"]["cpu"]["cores"] >= 1


def test_a_file_cut_short_of_its_newline_still_gets_one_line_per_record(harness, tmp_path) -> None:
    out = tmp_path / "demo.jsonl"
    out.write_text('{"benchmark": "demo", "label": "old"}')
    harness.append_line(out, {"benchmark": "demo", "label": "new"})
    assert [r["label"] for r in harness.read_records(out)] == ["old", "new"]


def test_the_partial_record_of_an_unfinished_run_goes_once_the_run_is_recorded(harness, tmp_path) -> None:
    out = tmp_path / "cuda_engine.jsonl"
    harness.save_partial(out, "cuda_engine", {"rows": 1})
    partial = tmp_path / "cuda_engine.jsonl.partial.tmp"
    assert json.loads(partial.read_text())["result"] == {"rows": 1}
    harness.append_record(out, "cuda_engine", {"rows": 2})
    assert not partial.exists()
    assert [r["result"] for r in harness.read_records(out)] == [{"rows": 2}]


def test_the_timer_warms_up_then_times_runs_of_several_calls(harness) -> None:
    counts = {"a": 0, "b": 0}

    def bump(name: str):
        return lambda: counts.__setitem__(name, counts[name] + 1)

    timed = harness.time_calls({"a": bump("a"), "b": bump("b")}, warmup=1, repeats=2, calls=3)
    assert counts == {"a": 9, "b": 9}  # (1 warm-up + 2 timed runs) x 3 calls
    assert [len(timed[name].runs_s) for name in "ab"] == [2, 2]
    assert timed["a"].min_s <= timed["a"].median_s


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_benchmark_goes_through_the_harness(script: Path) -> None:
    source = script.read_text()
    assert "import _harness" in source
    assert "sys.path" not in source  # the real model and test helpers come through the harness
    assert re.search(rf"add_record_options\(parser, \"{script.stem}\"", source)
    assert re.search(rf"append_record\([^)]*\"{script.stem}\"", source)


def test_results_hold_one_record_file_per_benchmark(harness) -> None:
    names = {p.stem for p in SCRIPTS} | {"gpu_checks"}
    files = sorted((BENCHMARKS / "results").iterdir())
    assert files and all(f.suffix == ".jsonl" and f.stem in names for f in files), files
    for path in files:
        records = harness.read_records(path)
        assert records and all(r["benchmark"] == path.stem and "result" in r for r in records)
