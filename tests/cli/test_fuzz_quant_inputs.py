"""Fuzz the text files `tessel quantize --calib` and `tessel qat --train` read: random bytes, other
encodings, empty and blank files, directories. Every file that is not text ends in exit code 2 with
a one-line message (a TesselError) naming the option, never a traceback, and nothing is written.
The windows asked for (4096 x 512 tokens) are more than any example holds, so a text that reads fine
is refused too, after the model loads; only `quantize --scheme w8a16` (which does not calibrate)
succeeds, given a real text."""

from __future__ import annotations

import itertools
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import hostile
import pytest
from cli_helpers import time_guard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import tiny_models
from tessel.cli import app
from tessel.errors import TesselError

FUZZ_SETTINGS = settings(
    max_examples=30,
    deadline=timedelta(seconds=60),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
DIRECTORY = None  # the example: a directory where the text file belongs
CONTENTS = st.one_of(
    hostile.raw_bytes(),
    st.sampled_from([b"", b" ", b"\n\n\t ", b"\x00", "\ufeff".encode(), DIRECTORY]),
)
_COUNTER = itertools.count()


@pytest.fixture(scope="module")
def workdir() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="tessel-fuzz-quant-"))
    tiny_models.make_tiny_checkpoint(folder / "model", seed=3)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _text_file(workdir: Path, content: bytes | None) -> Path:
    path = workdir / f"text-{next(_COUNTER)}.txt"
    if content is DIRECTORY:
        path.mkdir()
    else:
        path.write_bytes(content)
    return path


def _run(args: list) -> object:
    with time_guard(60):
        return CliRunner().invoke(app, [str(a) for a in args])


def _one_line_user_error(result) -> str:  # noqa: ANN001
    assert isinstance(result.exception, TesselError), (result.exit_code, repr(result.exception))
    message = str(result.exception).strip()
    assert result.exception.exit_code == 2 and message and "\n" not in message, message
    return message


def _is_text(content: bytes | None) -> bool:
    """What a text option accepts: UTF-8 (a BOM allowed), no NUL byte, not only white space."""
    if content is DIRECTORY or b"\x00" in content:
        return False
    try:
        return bool(content.decode("utf-8-sig").strip())
    except UnicodeDecodeError:
        return False


@FUZZ_SETTINGS
@given(content=CONTENTS, calibrates=st.booleans())
def test_quantize_calib_files(workdir, content, calibrates) -> None:
    """--act static calibrates (on more tokens than any example holds); w8a16 does not, and still
    refuses a --calib that is not text. Only a real text with the scheme that ignores it succeeds."""
    calib, out = _text_file(workdir, content), workdir / f"out-{next(_COUNTER)}"
    scheme = ["--act", "static"] if calibrates else ["--scheme", "w8a16"]
    args = ["quantize", workdir / "model", "--out", out, "--calib", calib, *scheme]
    result = _run([*args, "--calib-samples", "4096", "--seq-len", "512"])
    if not calibrates and _is_text(content):
        assert result.exit_code == 0, (result.output[-2000:], repr(result.exception))
        assert (out / "config.json").is_file()
        return
    assert "--calib" in _one_line_user_error(result)
    assert not out.exists() and not list(workdir.glob(f".{out.name}.*"))


@FUZZ_SETTINGS
@given(content=CONTENTS)
def test_qat_train_files(workdir, content) -> None:
    train, out = _text_file(workdir, content), workdir / f"out-{next(_COUNTER)}"
    args = ["qat", workdir / "model", "--out", out, "--train", train, "--group-size", "32"]
    result = _run([*args, "--seq-len", "512", "--batch-size", "4096", "--steps", "1"])
    message = _one_line_user_error(result)
    assert "--train" in message and "--calib" not in message
    assert not out.exists() and not list(workdir.glob(f".{out.name}.*"))
