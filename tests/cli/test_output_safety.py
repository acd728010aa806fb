"""Issue 27, item 1: tessel never deletes what it did not create.

`tessel quantize` / `tessel qat` used to `rmtree` whatever `--out` named (an unrelated folder, the
input model, its parent, `.`), with exit 0. Now an output directory is built beside the target and
moved into place; an existing target is refused unless `--overwrite`, and even then only a directory
tessel wrote (it holds `.tessel-output`) is replaced; the input, a folder holding it, the current
directory, the home directory and `/` are always refused. File outputs (`--json`, `--gantt`,
`--sensitivity`, `profile --out`) never replace one of the command's own input files.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from cli_helpers import time_guard
from typer.testing import CliRunner

import tiny_models
from tessel.cli import app
from tessel.errors import TesselError
from tessel.files import OUTPUT_MARKER

CLUSTER_YAML = "name: one\nnodes:\n  - name: n0\n    gpus: {type: A100-80G, count: 2}\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint (hidden 64, 2 layers) under models/llama in a folder of its own."""
    return tiny_models.make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "models" / "llama", seed=3)


@pytest.fixture
def model_copy(model_dir: Path, tmp_path: Path) -> Path:
    """A private copy (tmp_path/models/llama) a test may put a marker beside."""
    return Path(shutil.copytree(model_dir, tmp_path / "models" / "llama"))


def _invoke(args: list) -> object:
    with time_guard(120):
        return CliRunner().invoke(app, [str(a) for a in args])


def _refused(args: list, *words: str) -> str:
    """Run `tessel ARGS`: a TesselError (exit 2), one line, naming each of `words`."""
    result = _invoke(args)
    assert isinstance(result.exception, TesselError), (args, result.exit_code, result.output[-2000:])
    message = str(result.exception)
    assert result.exception.exit_code == 2 and "\n" not in message.strip(), message
    for word in words:
        assert word in message, (word, message)
    return message


def _ok(args: list) -> None:
    result = _invoke(args)
    assert result.exit_code == 0, (args, result.output[-2000:], repr(result.exception))


def _snapshot(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `folder` (hidden ones too)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def _quantize(model: Path, out: Path | str, *extra: str) -> list:
    return ["quantize", model, "--out", out, *extra]


def _mark(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / OUTPUT_MARKER).write_text("tessel\n")
    return folder


# ---- quantize --out -------------------------------------------------------------------------------


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_an_unrelated_existing_directory_is_refused_and_kept(model_dir, tmp_path, overwrite) -> None:
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    (other / "sentinel.txt").write_text("mine")
    (other / "sub" / "deep.txt").write_text("also mine")
    before = _snapshot(other)
    words = ("not written by tessel", OUTPUT_MARKER) if overwrite else ("already exists", "--overwrite")
    _refused(_quantize(model_dir, other, *overwrite), *words)
    assert _snapshot(other) == before
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_the_input_model_directory_survives_byte_for_byte(model_copy, tmp_path, overwrite) -> None:
    _mark(model_copy)  # even a model directory tessel wrote is never its own command's output
    before = _snapshot(model_copy)
    _refused(_quantize(model_copy, model_copy, *overwrite), "input")
    _refused(_quantize(model_copy, f"{model_copy}/", *overwrite), "input")  # spelled another way
    assert _snapshot(model_copy) == before
    assert _leftovers(model_copy.parent) == []


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_a_parent_of_the_input_is_refused(model_copy, tmp_path, overwrite) -> None:
    parent = _mark(model_copy.parent)  # marked: refused for holding the input, not for the marker
    (parent / "beside.txt").write_text("next to the model")
    before = _snapshot(tmp_path)
    _refused(_quantize(model_copy, parent, *overwrite), "holds an input")
    _refused(_quantize(model_copy, tmp_path, *overwrite), "holds an input")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("out", [".", "CWD", "..", "sub/.."], ids=["dot", "absolute", "dotdot", "sub-dotdot"])
def test_the_current_directory_and_its_parents_are_refused(model_dir, tmp_path, monkeypatch, out) -> None:
    work = _mark(tmp_path / "work")  # marked, and --overwrite: still refused
    (work / "sub").mkdir()
    (work / "notes.txt").write_text("keep")
    monkeypatch.chdir(work)
    before = _snapshot(tmp_path)
    target = str(work) if out == "CWD" else out
    _refused(_quantize(model_dir, target, "--overwrite"), "current directory")
    assert _snapshot(tmp_path) == before and Path.cwd() == work


def test_root_and_home_are_refused(model_dir, tmp_path, monkeypatch) -> None:
    home = _mark(tmp_path / "home")  # a marked home directory, and --overwrite: still refused
    (home / "thesis.tex").write_text("years of work")
    monkeypatch.setenv("HOME", str(home))
    before = _snapshot(home)
    _refused(_quantize(model_dir, "/", "--overwrite"), "root directory")
    _refused(_quantize(model_dir, "~", "--overwrite"), "home directory")
    _refused(_quantize(model_dir, home, "--overwrite"), "home directory")
    _refused(_quantize(model_dir, tmp_path, "--overwrite"), "home directory")  # holds home
    assert _snapshot(home) == before


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_an_existing_file_target_is_refused(model_dir, tmp_path, overwrite) -> None:
    target = tmp_path / "results.csv"
    target.write_text("a,b\n1,2\n")
    _refused(_quantize(model_dir, target, *overwrite), "not a directory")
    assert target.read_text() == "a,b\n1,2\n"
    assert _leftovers(tmp_path) == []


def test_a_symlink_target_is_refused(model_dir, tmp_path) -> None:
    real = _mark(tmp_path / "real")
    (real / "keep.txt").write_text("keep")
    (tmp_path / "link").symlink_to(real)
    _refused(_quantize(model_dir, tmp_path / "link", "--overwrite"), "symbolic link")
    assert (real / "keep.txt").read_text() == "keep"


def test_overwrite_replaces_a_directory_tessel_wrote(model_dir, tmp_path) -> None:
    out = tmp_path / "q"
    _ok(_quantize(model_dir, out))
    assert (out / OUTPUT_MARKER).is_file() and (out / "config.json").is_file()
    first = _snapshot(out)
    _refused(_quantize(model_dir, out, "--scheme", "w8a16"), "already exists", "--overwrite")
    assert _snapshot(out) == first
    _ok(_quantize(model_dir, out, "--scheme", "w8a16", "--overwrite"))
    second = _snapshot(out)
    assert second != first and (out / OUTPUT_MARKER).is_file()
    assert '"format": "pack-quantized"' in (out / "config.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_an_empty_existing_directory_is_used(model_dir, tmp_path) -> None:
    out = tmp_path / "made-by-mkdir"
    out.mkdir()
    _ok(_quantize(model_dir, out))
    assert (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made-by-mkdir"]


def test_a_failed_run_keeps_the_old_output_and_leaves_no_staging(model_dir, tmp_path, monkeypatch) -> None:
    import tessel.quant.formats.checkpoint

    out = tmp_path / "q"
    _ok(_quantize(model_dir, out))
    before = _snapshot(out)

    def full_disk(*_args, **_kwargs) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tessel.quant.formats.checkpoint, "save_file", full_disk)
    _refused(_quantize(model_dir, out, "--scheme", "w8a16", "--overwrite"), "No space left", str(out))
    _refused(_quantize(model_dir, tmp_path / "new"), "No space left")
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q"]


def test_out_is_required_unless_sensitivity(model_dir, tmp_path) -> None:
    _refused(["quantize", model_dir], "--out", "--sensitivity")
    result = _invoke(["quantize", "--help"])
    assert "required unless --sensitivity" in " ".join(result.output.replace("│", " ").split())


# ---- --calib is checked even when the scheme does not calibrate ----------------------------------


@pytest.mark.parametrize("kind", ["binary", "empty", "blank", "directory", "missing"])
def test_a_bad_calib_file_is_refused_even_when_unused(model_dir, tmp_path, kind) -> None:
    calib = tmp_path / "calib.txt"
    if kind == "directory":
        calib.mkdir()
    elif kind != "missing":
        calib.write_bytes({"binary": bytes(range(256)), "empty": b"", "blank": b" \n\t\n"}[kind])
    out = tmp_path / "out"
    _refused(_quantize(model_dir, out, "--calib", calib), "--calib", str(calib))  # w8a8 dynamic: no calib
    assert not out.exists()


# ---- the other commands' directory and file outputs ------------------------------------------------


def test_qat_refuses_the_same_targets(model_copy, tmp_path) -> None:
    train = tmp_path / "train.txt"
    train.write_text((tiny_models.CORPUS + "\n") * 6)
    other = tmp_path / "other"
    other.mkdir()
    (other / "sentinel.txt").write_text("mine")
    before = _snapshot(tmp_path)
    qat = ["qat", model_copy, "--train", train, "--steps", "1", "--seq-len", "16", "--group-size", "32"]
    _refused([*qat, "--out", other], "already exists", "--overwrite")
    _refused([*qat, "--out", other, "--overwrite"], "not written by tessel")
    _refused([*qat, "--out", model_copy, "--overwrite"], "input")
    _refused([*qat, "--out", model_copy.parent, "--overwrite"], "holds an input")
    _refused([*qat, "--out", train, "--overwrite"], "input")
    assert _snapshot(tmp_path) == before


def test_quantize_sensitivity_never_writes_over_its_calib_file(model_dir, tmp_path) -> None:
    calib = tmp_path / "calib.txt"
    calib.write_text((tiny_models.CORPUS + "\n") * 6)
    _refused(["quantize", model_dir, "--sensitivity", calib, "--calib", calib], "input", "--sensitivity")
    assert calib.read_text() == (tiny_models.CORPUS + "\n") * 6


def test_plan_json_never_writes_over_its_cluster_file(tmp_path) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER_YAML)
    args = ["plan", "--model", "llama-2-7b", "--cluster", cluster, "--solver", "dp", "--json", cluster]
    _refused(args, "--json", "input")
    assert cluster.read_text() == CLUSTER_YAML
    (tmp_path / "hard.yaml").hardlink_to(cluster)  # the same file under another name
    _refused([*args[:-1], tmp_path / "hard.yaml"], "input")
    assert cluster.read_text() == CLUSTER_YAML


def test_plan_json_replaces_an_existing_output_file_atomically(tmp_path) -> None:
    out = tmp_path / "plan.json"
    out.write_text("old")
    _ok(["plan", "--model", "llama-2-7b", "--cluster", "mixed-a100-v100-t4", "--solver", "dp", "--json", out])
    assert out.read_text().startswith("{") and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_simulate_outputs_never_write_over_the_plan_or_each_other(plan_file, tmp_path) -> None:
    document = plan_file.read_text()
    base = ["simulate", "--plan", plan_file, "--requests", "2"]
    _refused([*base, "--json", plan_file], "--json", "input")
    _refused([*base, "--gantt", tmp_path / "g.svg", "--json", tmp_path / "g.svg"], "--gantt and --json")
    assert plan_file.read_text() == document


def test_chunk_json_never_writes_over_the_plan(plan_file) -> None:
    document = plan_file.read_text()
    _refused(["chunk", "--plan", plan_file, "--seq-len", "4096", "--json", plan_file], "--json", "input")
    assert plan_file.read_text() == document


def test_profile_out_never_writes_over_the_model_config(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384}'
    )
    text = config.read_text()
    _refused(["profile", "--model", config, "--out", config, "--budget-s", "1"], "--out", "input")
    assert config.read_text() == text


def test_launch_outputs_are_checked_before_the_stages_start(plan_file, model_dir, tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"Hello"\n')
    base = ["launch", "--plan", plan_file, "--model", model_dir, "--prompts-file", prompts]
    _refused([*base, "--json", prompts], "--json", "input")
    assert prompts.read_text() == '"Hello"\n'
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "stage0.log").write_text("my own log")
    _refused([*base, "--run-dir", mine], "--run-dir", "did not write")
    _refused([*base, "--run-dir", model_dir], "--run-dir", "input")
    assert (mine / "stage0.log").read_text() == "my own log"


def test_a_gguf_cache_entry_tessel_did_not_write_is_kept(tmp_path, monkeypatch) -> None:
    from tessel.models import gguf as gguf_import

    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path / "cache"))
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF")
    stat = file.stat()
    entry = gguf_import.cache_root() / f"model-{stat.st_size}-{int(stat.st_mtime)}"
    entry.mkdir(parents=True)
    (entry / "sentinel.txt").write_text("not tessel's")
    with pytest.raises(TesselError, match="not written by tessel"):
        gguf_import.gguf_checkpoint(file)
    assert (entry / "sentinel.txt").read_text() == "not tessel's"
    (entry / OUTPUT_MARKER).write_text("tessel\n")  # a leftover of tessel's own: replaced (here: refused
    with pytest.raises(TesselError, match="not a readable GGUF"):  # as a file, and kept as it was)
        gguf_import.gguf_checkpoint(file)
    assert (entry / "sentinel.txt").is_file() and _leftovers(entry.parent) == []
